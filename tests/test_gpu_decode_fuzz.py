"""attngen.decode under the paged decode regime (attngen/fuzz/paged.py) on a GPU (marker `gpu`):
random lengths up to 128k, 1 to 16 new tokens, page sizes 1 to 256 with shuffled, shared and spare
(NaN) pages, garbage page ids past each sequence's pages, NaN past every length, contiguous caches,
forced and chosen split counts, every decode-capable problem of the fuzz pool."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attngen
from attngen import targets
from attngen.fuzz.paged import check_decode_case, decode_cases, decode_specs

pytestmark = pytest.mark.gpu


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_paged_decode_matches_the_reference_under_random_caches(data):
    import torch

    case = data.draw(decode_cases(decode_specs(targets.device_target(torch.cuda.current_device()))))
    bad = check_decode_case(case, attngen.decode, "cuda")
    assert bad is None, f"{case.spec.name}: {case.label()}: {bad}"
