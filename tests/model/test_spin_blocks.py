"""SPIN model check of the MoE consumer's incremental expert blocks (docs/model/blocks.pml,
docs/PROTOCOL.md "Incremental expert blocks"; RFC dispatch option 2, issue 19 item 1).

One test per blocks.pml configuration of scripts/check_model.py (blk_*, bugblk_*).  The correct
model must verify with 0 errors and a complete search; every injected bug must produce a
counterexample against its own rule.

Rules pinned (property names as in blocks.pml):
  NO_READ_BEFORE_LANDED  a consumer reads only rows of this call that landed in the block it claimed
                         (BUG_SEAL_ON_RESERVE, BUG_LAND_BEFORE_STORE break it)
  COMPUTED_ONCE          no reserved row is computed twice
                         (BUG_SEAL_AT_SOURCE_EOS, BUG_CLAIM_NO_CAS break it)
  ALL_COMPUTED           at the end of a call every row was computed and every allocated block
                         claimed (BUG_EXIT_BEFORE_SEAL breaks it)
  NO_OVERFLOW            every reservation fits its expert's block list and the pool of
                         padded_rows_bound / block_m blocks (BUG_SMALL_POOL breaks it)
  COMPLETION             no invalid end state (every loop is bounded, so every run ends)
"""
from __future__ import annotations

import pytest

from tests.model.spin_driver import assert_macros_only_in, check_config, check_model, needs_tools

S, P, X = check_model.SAFETY, check_model.PASS, check_model.CEX
BLOCKS_PINNED = {
    "blk_fixed": (S, P, None, ()),
    "blk_route_any": (S, P, None, ("ROUTE_ANY",)),
    "blk_two_calls": (S, P, None, ("NINV=2",)),
    "blk_cons3": (S, P, None, ("NCONS=3",)),
    "bugblk_seal_on_reserve": (S, X, "NO_READ_BEFORE_LANDED", ("BUG_SEAL_ON_RESERVE",)),
    "bugblk_land_before_store": (S, X, "NO_READ_BEFORE_LANDED", ("BUG_LAND_BEFORE_STORE",)),
    "bugblk_seal_at_source_eos": (S, X, "COMPUTED_ONCE", ("BUG_SEAL_AT_SOURCE_EOS",)),
    "bugblk_claim_no_cas": (S, X, "COMPUTED_ONCE", ("BUG_CLAIM_NO_CAS",)),
    "bugblk_exit_before_seal": (S, X, "ALL_COMPUTED", ("BUG_EXIT_BEFORE_SEAL",)),
    "bugblk_small_pool": (S, X, "NO_OVERFLOW", ("BUG_SMALL_POOL",)),
}
BLOCK_CONFIGS = [c for c in check_model.CONFIGS if c.model == check_model.BLOCKS_MODEL]
MODEL = check_model.MODEL_DIR / check_model.BLOCKS_MODEL


def test_blocks_configs_pinned():
    """Every blocks.pml check exists with its mode, expectation, expected property and macros; each
    bug macro is used by exactly one configuration and named in the model's header."""
    got = {c.name: (c.check, c.expect, c.prop, c.macros) for c in BLOCK_CONFIGS}
    assert got == BLOCKS_PINNED
    text = MODEL.read_text()
    for name, (_, expect, prop, macros) in BLOCKS_PINNED.items():
        if expect == X:
            (bug,) = [m for m in macros if m.startswith("BUG_")]
            assert f"#ifdef {bug}" in text or f"#ifndef {bug}" in text, name
            assert f"hidden byte {prop} = 1;" in text, name


def test_blocks_bug_macros_only_in_blocks_model():
    """The blocks.pml bug macros are not passed to ring.pml, and vice versa."""
    bugs = {m for c in BLOCK_CONFIGS for m in c.macros if m.startswith("BUG_")}
    assert_macros_only_in(check_model.BLOCKS_MODEL, bugs)


@needs_tools
@pytest.mark.spin
@pytest.mark.parametrize("cfg", BLOCK_CONFIGS, ids=lambda c: c.name)
def test_spin_blocks_config(cfg):
    check_config(cfg)
