"""The search of `attngen fuzz --decode`: paged decode cases (attngen/fuzz/paged.py) through the
forward fuzz's search (search.run_search): the same seed, examples, time budget, shrinking, sticky
GPU errors and harness errors. Its first cases are three per spec (pages of 16, pages of 256 and a
contiguous cache: paged.first_decode_cases), so every kernel runs even in a short search; a failure's
search then draws only the caches its kernel takes."""

from __future__ import annotations

from attngen.fuzz.decode_check import case_kernel_name, run_decode_case
from attngen.fuzz.paged import MAX_PAGE_SIZE, DecodeCase, DecodeLimits, decode_cases, first_decode_cases
from attngen.fuzz.search import OnCase, SearchOutcome, check_search_arguments, run_search

# Instrumented kernels run 10-1000x slower: the sanitizer's sample prefers cases whose caches hold
# fewer values than this (lengths x kv heads x head_dim, summed over the sequences).
SANITIZE_MAX_CACHE = 2**20


class DecodeOutcome(SearchOutcome):
    """A search outcome whose per-kernel stats count new tokens (longest_seq_q) and cache lengths
    (longest_seq_k)."""

    @staticmethod
    def lengths(case: DecodeCase) -> tuple[int, int]:
        return case.seq_q, max(case.lengths)

    @staticmethod
    def sample_key(case: DecodeCase, target) -> tuple:
        return decode_sample_key(case)


def decode_sample_key(case: DecodeCase) -> tuple:
    """Smaller is a better case to sanitize: cheap, with a partial last page, splits to combine (the
    second kernel), several sequences and new tokens."""
    cache = sum(case.lengths) * case.heads_kv * case.spec.head_dim
    partial = case.page_size is not None and any(n % case.page_size for n in case.lengths)
    edges = partial + (case.num_splits is not None and case.num_splits > 1) + (case.batch > 1) + (case.seq_q > 1)
    return (cache > SANITIZE_MAX_CACHE, -edges, cache)


def search_decode(specs, runner, *, examples: int, seed: int, time_budget: float | None = None,
                  limits: DecodeLimits = DecodeLimits(), on_case: OnCase | None = None) -> SearchOutcome:
    """Run up to `examples` decode cases over `specs` with a decode runner (attngen/fuzz/decode_runners.py);
    stop early at the time budget, the first failure (shrunk) or the first harness error (not shrunk)."""
    check_search_arguments(examples, time_budget)
    specs = list(specs)
    if not specs:
        raise ValueError("specs=() is invalid; allowed: at least one AttentionSpec a decode family runs")

    def focus(case: DecodeCase):  # the failing case's kernel: its spec, and the caches that kernel takes
        if case.page_size is None:
            return decode_cases([case.spec], limits, paged=False)
        kernel = runner.kernel_name(case.spec, case.page_size)  # pages of whole key blocks have their own
        same = tuple(size for size in range(1, MAX_PAGE_SIZE + 1) if runner.kernel_name(case.spec, size) == kernel)
        return decode_cases([case.spec], limits, paged=True, page_sizes=same)

    return run_search(decode_cases(specs, limits), first_decode_cases(specs, limits)[:examples], focus, runner,
                      DecodeOutcome(seed=seed, examples=examples), time_budget, on_case, check=run_decode_case,
                      kernel_of=case_kernel_name)
