"""SPIN model check of how the persistent decode consumer's blocks take their units (docs/model/claim.pml,
docs/PROTOCOL.md "The decode path"; device/kernels/moe_persistent.cu with persistent_schedule.cuh's UnitWalk).

One test per claim.pml configuration of scripts/check_model.py (claim_*, bugclaim_*). The correct model must verify
with 0 errors and a complete search - the dynamic claim ends however few of the launch's blocks run at once; every
injected bug must produce a counterexample against its own rule.

Rules pinned (property names as in claim.pml):
  COMPUTED_ONCE  no unit runs twice
  ORDERED        an L2 unit runs after every L1 unit of its expert (BUG_NO_WAIT breaks it)
  ALL_COMPUTED   when every block ended, every unit ran
  COMPLETION     no invalid end state: the launch ends with any number of blocks running at once (the strided
                 claim with fewer SMs than blocks, STATIC, and L2 units listed first, BUG_L2_FIRST, break it)
"""
from __future__ import annotations

import pytest

from tests.model.spin_driver import assert_macros_only_in, check_config, check_model, needs_tools

S, P, X = check_model.SAFETY, check_model.PASS, check_model.CEX
COMPLETION = check_model.COMPLETION
CLAIM_PINNED = {
    "claim_r1": (S, P, None, ()),
    "claim_r2_ahead": (S, P, None, ("R=2", "D=2")),
    "claim_resident": (S, P, None, ("R=3", "D=2")),
    "claim_g4_r2": (S, P, None, ("G=4", "R=2", "D=2")),
    "claim_static_resident": (S, P, None, ("STATIC", "R=3")),
    "bugclaim_static": (S, X, COMPLETION, ("STATIC", "R=2", "D=2")),
    "bugclaim_l2_first": (S, X, COMPLETION, ("BUG_L2_FIRST",)),
    "bugclaim_no_wait": (S, X, "ORDERED", ("BUG_NO_WAIT", "R=2")),
}
CLAIM_CONFIGS = [c for c in check_model.CONFIGS if c.model == check_model.CLAIM_MODEL]
MODEL = check_model.MODEL_DIR / check_model.CLAIM_MODEL


def test_claim_configs_pinned():
    """Every claim.pml check exists with its mode, expectation, expected property and macros; each variant macro
    is one the model reads, and each asserted property is declared there."""
    got = {c.name: (c.check, c.expect, c.prop, c.macros) for c in CLAIM_CONFIGS}
    assert got == CLAIM_PINNED
    text = MODEL.read_text()
    for name, (_, expect, prop, macros) in CLAIM_PINNED.items():
        for macro in (m for m in macros if "=" not in m):
            assert f"#ifdef {macro}" in text, name
        if expect == X and prop != COMPLETION:
            assert f"hidden byte {prop} = 1;" in text, name


def test_claim_macros_only_in_claim_model():
    """The claim model's variant macros are not passed to the other models."""
    assert_macros_only_in(check_model.CLAIM_MODEL, {m for c in CLAIM_CONFIGS for m in c.macros if "=" not in m})


@needs_tools
@pytest.mark.spin
@pytest.mark.parametrize("cfg", CLAIM_CONFIGS, ids=lambda c: c.name)
def test_spin_claim_config(cfg):
    check_config(cfg)
