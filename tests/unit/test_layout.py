"""The symmetric layout: regions in order, line-aligned, non-overlapping, ending at total_bytes; and
the descriptor mirrored field for field by device/include/chunkring/layout/ring_desc.cuh."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkring.errors import ChunkringUsageError
from chunkring.ring.layout import CONTROL, DESC_FIELDS, LAYOUT_VERSION, LINE, META, STATUS, RingLayout
from chunkring.ring.spec import PayloadFormat, RingSpec

HEADER = Path(__file__).resolve().parents[2] / "device/include/chunkring/layout/ring_desc.cuh"


def header_text():
    return HEADER.read_text()


def test_descriptor_fields_match_the_cuda_struct():
    body = re.search(r"struct RingDesc \{(.*?)\};", header_text(), re.S).group(1)
    fields = re.findall(r"^\s*u64 (\w+);", body, re.M)
    assert tuple(fields) == DESC_FIELDS
    size = int(re.search(r"sizeof\(RingDesc\) == (\d+) \* sizeof\(u64\)", header_text()).group(1))
    assert size == len(DESC_FIELDS)


def test_constants_match_the_cuda_header():
    text = header_text()
    assert f"kRingLayoutVersion = {LAYOUT_VERSION};" in text
    for py, prefix in ((CONTROL, "kControl"), (STATUS, "kStatus"), (META, "kMeta")):
        for name, index in py.items():
            camel = "".join(part.capitalize() for part in name.split("_"))
            assert re.search(rf"{prefix}{camel} = {index}\b", text), (prefix, name)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64), st.integers(1, 8), st.integers(1, 64), st.sampled_from([128, 256, 7168]),
       st.sampled_from(list(PayloadFormat)), st.integers(1, 8))
def test_regions_are_ordered_aligned_and_disjoint(world, slots, tokens, hidden, payload, topk):
    spec = RingSpec(world, slots, tokens, hidden, payload, topk, num_experts=64 * world)
    layout = RingLayout(spec)
    end = 0
    for region in layout.regions.values():
        assert region.offset % LINE == 0 and region.offset >= end
        end = region.end
    assert layout.total_bytes == -(-end // LINE) * LINE
    assert layout.regions["route_ready"].shape[0] == world
    assert layout.regions["route_ready"].shape[1] * 8 % LINE == 0  # a source's row owns its lines


def test_views_are_typed_windows_of_one_buffer():
    spec = RingSpec(2, 2, 4, 256, PayloadFormat.FP8_E4M3, 2, 8)
    layout = RingLayout(spec)
    buf = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    views = layout.views(buf)
    assert views["x"].dtype == torch.float8_e4m3fn and views["x"].shape == (2, 4, 256)
    assert views["x_sf"].shape == (2, 4, 2) and views["topk_idx"].dtype == torch.int32
    views["status"][STATUS["code"]] = 7
    offset = layout.regions["status"].offset
    assert buf[offset:offset + 8].view(torch.int64).item() == 7
    with pytest.raises(ChunkringUsageError):
        layout.views(torch.zeros(layout.total_bytes - 1, dtype=torch.uint8))


def test_descriptor_values():
    spec = RingSpec(4, 2, 128, 7168, PayloadFormat.FP8_E4M3, 8, 256)
    layout = RingLayout(spec)
    words = layout.descriptor(my_pe=3, base=0x7000_0000_0000, timeout_ns=5).tolist()
    desc = dict(zip(DESC_FIELDS, words, strict=True))
    assert desc["layout_version"] == LAYOUT_VERSION and desc["desc_bytes"] == 8 * len(DESC_FIELDS)
    assert desc["my_pe"] == 3 and desc["x_row_bytes"] == 7168 and desc["x_sf_row_floats"] == 56
    assert desc["off_status"] == layout.regions["status"].offset and desc["total_bytes"] == layout.total_bytes
    assert layout.descriptor(my_pe=0, base=0, timeout_ns=1).dtype == np.uint64
    with pytest.raises(ChunkringUsageError):
        layout.descriptor(my_pe=4, base=0, timeout_ns=1)


def test_memory_against_the_full_input_region():
    spec = RingSpec(8, 2, 512, 7168, PayloadFormat.FP8_E4M3, 8, 256)
    layout = RingLayout(spec)
    assert layout.payload_bytes_per_token == 7168 + 56 * 4 + 8 * 4 + 8 * 4
    assert layout.full_input_bytes(8192) == 8192 * layout.payload_bytes_per_token
    # The slots dominate: 2 x 512 of 8192 tokens is 1/8 of the input region, plus a few lines of words.
    assert layout.full_input_bytes(1024) < layout.total_bytes < layout.full_input_bytes(1024) + 64 * 1024
    with pytest.raises(ChunkringUsageError):
        layout.full_input_bytes(-1)


def test_the_descriptor_carries_the_failure_words_address():
    layout = RingLayout(RingSpec(2, 2, 4, 256, PayloadFormat.BF16, 2, 8))
    field = DESC_FIELDS.index("failure_word")
    assert int(layout.descriptor(my_pe=0, base=0, timeout_ns=1)[field]) == 0  # default: no host word
    address = 0x7F00_1234_5000
    assert int(layout.descriptor(my_pe=0, base=0, timeout_ns=1, failure_word=address)[field]) == address
    for bad in (-1, 1 << 64, 1.5, True):
        with pytest.raises(ChunkringUsageError):
            layout.descriptor(my_pe=0, base=0, timeout_ns=1, failure_word=bad)


def test_the_status_region_holds_the_abort_notice():
    layout = RingLayout(RingSpec(2, 2, 4, 256, PayloadFormat.BF16, 2, 8))
    assert layout.regions["status"].shape[0] > max(STATUS.values())
