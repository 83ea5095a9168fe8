"""Each lesson doc's pitfalls and planted-bug exercises are mutations the build track checks (scripts/build_track/
planted.py): every item names one (`<!-- mutation: ID -->`) that scripts/checks/mutations.py holds, or says why it
is not a planted bug. That each mutation fails its own task's tests, in a learner's terms, is `course.py verify`
(tests/test_build_track.py's slow test)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT / "scripts" / "checks")]
from build_track.planted import doc_items, in_learners_terms, owner  # noqa: E402
from build_track.tasks import lessons  # noqa: E402
from course import doc_for  # noqa: E402
from mutations import MUTATIONS  # noqa: E402

KNOWN = {m.id: m for m in MUTATIONS}


@pytest.mark.parametrize("lesson", lessons(ROOT), ids=lambda n: f"L{n}")
def test_every_pitfall_and_exercise_names_a_mutation_or_why_not(lesson):
    doc = doc_for(lesson)
    items = doc_items(doc.read_text())
    assert any(i.section.startswith("Pitfalls") for i in items), f"{doc.name} has no Pitfalls section"
    for item in items:
        assert item.mutations or item.exempt, (
            f"{doc.name}, {item.section}: `{item.title}` names no mutation: add <!-- mutation: ID --> "
            "(scripts/checks/mutations.py) or <!-- no mutation: why -->")
        if item.section.startswith("Pitfalls") and item.exempt:
            assert "_appendix.md" in item.title or "appendix" in item.exempt, (
                f"{doc.name}: pitfall `{item.title}` is exempt ({item.exempt}); a pitfall is a planted bug unless "
                "it only points to the appendix")
        unknown = [m for m in item.mutations if m not in KNOWN]
        assert not unknown, f"{doc.name}: `{item.title}` names {unknown}, which scripts/checks/mutations.py lacks"


def test_a_mutation_belongs_to_the_task_whose_function_it_edits():
    slot = KNOWN["slot-no-block-size"]
    assert owner(ROOT, slot.file, slot.old) == (2, 3)  # Request.slot is task 3 of L2
    hf = KNOWN["hf-no-mask"]
    assert owner(ROOT, hf.file, hf.old) is None  # the oracle is no task's code


@pytest.mark.parametrize("message, ok", [
    ("AssertionError: S=7, block table [3]: position 0 is offset 0 of block 3, slot 21; got 3\nassert 3 == 21", True),
    ("Failed: reserve left 2 blocks behind after PoolExhausted", True),
    ("AssertionError: assert [0, 1] == []", False),
    ("Failed: DID NOT RAISE <class 'lessons.l2_token_flat.allocator.PoolExhausted'>", False),
    ("IndexError: index -1 is out of bounds for dimension 0 with size 0", False),
    ("AssertionError: Tensor-likes are not close!", False),
])
def test_a_failure_in_a_learners_terms_is_the_tests_own_words(message, ok):
    assert in_learners_terms(message) is ok, message
