"""The MoE layer's descriptors (chunkring.moe._engine.descriptors) mirrored field for field by
device/include/chunkring/layout/moe_desc.cuh, and the stage's descriptor holding its tensors' addresses."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from chunkring import ChunkringUsageError, MoEConfig, PayloadFormat
from chunkring.moe._engine.descriptors import MOE_LAYOUT_VERSION, POOL_FIELDS, STAGE_FIELDS, descriptor_words
from chunkring.moe._engine.stage import Stage

HEADER = Path(__file__).resolve().parents[2] / "device/include/chunkring/layout/moe_desc.cuh"


@pytest.mark.parametrize(("struct", "fields"), [("StageDesc", STAGE_FIELDS), ("PoolDesc", POOL_FIELDS)])
def test_fields_match_the_cuda_struct(struct, fields):
    text = HEADER.read_text()
    body = re.search(rf"struct {struct} \{{(.*?)\}};", text, re.S).group(1)
    assert tuple(re.findall(r"^\s*u64 (\w+);", body, re.M)) == fields
    size = int(re.search(rf"sizeof\({struct}\) == (\d+) \* sizeof\(u64\)", text).group(1))
    assert size == len(fields)
    assert fields[:2] == ("layout_version", "desc_bytes")  # what a kernel checks first


def test_version_matches_the_cuda_header():
    assert f"kMoeLayoutVersion = {MOE_LAYOUT_VERSION};" in HEADER.read_text()


def test_words_name_every_field_once():
    values = {name: i for i, name in enumerate(STAGE_FIELDS[2:], start=10)}
    words = descriptor_words(STAGE_FIELDS, values)
    assert words.dtype == np.uint64 and words[0] == MOE_LAYOUT_VERSION and words[1] == 8 * len(STAGE_FIELDS)
    assert words[2:].tolist() == list(values.values())
    with pytest.raises(KeyError, match="missing"):
        descriptor_words(STAGE_FIELDS, {k: v for k, v in values.items() if k != "held"})
    with pytest.raises(KeyError, match="unknown"):
        descriptor_words(STAGE_FIELDS, {**values, "typo": 1})


@pytest.mark.parametrize("payload", [PayloadFormat.FP8_E4M3, PayloadFormat.BF16], ids=["fp8", "bf16"])
def test_stage_descriptor(payload):
    cfg = MoEConfig(num_experts=8, hidden=256, intermediate=128, topk=2, max_tokens_per_rank=16, payload=payload)
    stage = Stage.allocate(cfg, 4, torch.device("cpu"), expert_lo=2, expert_hi=4)
    desc = dict(zip(STAGE_FIELDS, stage.desc.tolist(), strict=True))
    assert (desc["sources"], desc["token_capacity"], desc["topk"]) == (4, 16, 2)
    assert desc["row_bytes"] == (256 if payload.has_scales else 512)
    assert desc["sf_per_row"] == (2 if payload.has_scales else 0)
    assert (desc["expert_lo"], desc["expert_hi"]) == (2, 4)
    for name in ("x", "sf", "idx", "w", "held"):
        assert desc[name] == getattr(stage, name).data_ptr(), name
    assert bool((stage.idx == -1).all()) and stage.held.tolist() == [-1] * 4


def test_a_stage_refuses_tensors_its_kernels_could_not_read():
    idx = torch.full((2, 4, 2), -1, dtype=torch.int32)
    good = dict(x=torch.zeros(2, 4, 256, dtype=torch.float8_e4m3fn), sf=torch.zeros(2, 4, 2),
                idx=idx, w=torch.zeros(2, 4, 2))
    Stage(**good, expert_lo=0, expert_hi=2)
    bad = {
        "x": dict(x=torch.zeros(2, 4, 256)),  # fp32 rows
        "sf": dict(sf=torch.zeros(2, 3, 2)),  # another row count
        "w": dict(w=torch.zeros(2, 2, 4).transpose(1, 2)),  # not contiguous
        "held": dict(held=torch.zeros(3, dtype=torch.int64)),
    }
    for field, change in bad.items():
        with pytest.raises(ChunkringUsageError) as info:
            Stage(**{**good, **{k: v for k, v in change.items() if k != "held"}}, expert_lo=0, expert_hi=2,
                  held=change.get("held"))
        assert info.value.field == field
    with pytest.raises(ChunkringUsageError, match="expert_lo < expert_hi"):
        Stage(**good, expert_lo=2, expert_hi=2)
