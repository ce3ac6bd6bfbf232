"""scripts/train_embedded_model.py's retrieval documents (issue 30's passkey stage): a row holds the evaluation's
instruction, needle and question, the answer span is exactly " <key>." of the needle's key, and rows are a pure
function of (seed, index)."""

from __future__ import annotations

import re
import runpy
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from oal.evaluate.passkey import PASSKEY

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_embedded_model.py"


@pytest.fixture(scope="module")
def script():
    return Namespace(**runpy.run_path(str(SCRIPT), run_name="train_embedded_model"))  # its functions, not main()


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from oal.models.registry import DEFAULT_MODEL_DIR

    return AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)


def test_rows_hold_a_passkey_document_and_its_answer(script, tok):
    args = Namespace(seed=0, seq=192)
    stream = torch.randint(3, tok.vocab_size, (5000,), generator=torch.Generator().manual_seed(0))
    for index in range(6):
        row, start, end = script.retrieval_row(index, stream, tok, args)
        assert row.shape == (args.seq + 1,) and 0 < start < end <= args.seq
        answer = tok.decode(row[start:end])
        key = re.fullmatch(r" (\d{5})\.", answer).group(1)
        before = tok.decode(row[:start])
        assert before.startswith(PASSKEY.intro) and before.endswith(PASSKEY.question)
        assert PASSKEY.needle.format(key=key).strip() in before
        assert int(row[end]) == tok.eos_token_id
        again = script.retrieval_row(index, stream, tok, args)
        assert torch.equal(again[0], row) and again[1:] == (start, end)
    other = script.retrieval_row(0, stream, tok, Namespace(seed=1, seq=192))[0]
    assert not torch.equal(other, script.retrieval_row(0, stream, tok, args)[0])


def test_mixed_batch_masks_only_the_answers_of_its_retrieval_rows(script, tok):
    args = Namespace(seed=0, seq=128, batch=4, retrieval_frac=0.5)
    stream = torch.randint(3, tok.vocab_size, (5000,), generator=torch.Generator().manual_seed(1))
    xb, answers = script.mixed_batch(3, stream, tok, args)
    assert xb.shape == answers.shape == (4, 129)
    assert answers[:2].any(dim=1).all() and not answers[2:].any()
    for b in range(2):
        assert re.fullmatch(r" \d{5}\.", tok.decode(xb[b][answers[b]]))


def test_short_rows_fit_when_the_room_is_smaller_than_a_filler_unit(script, tok):
    """At --seq 128 (the curriculum stage) the filler room is 16-37 tokens: a repeated unit never outgrows it, and
    every row is exactly seq + 1 tokens with its answer inside."""
    args = Namespace(seed=0, seq=128)
    stream = torch.randint(3, tok.vocab_size, (5000,), generator=torch.Generator().manual_seed(2))
    for index in range(64):
        row, start, end = script.retrieval_row(index, stream, tok, args)
        assert row.shape == (args.seq + 1,) and 0 < start < end <= args.seq
        assert re.fullmatch(r" \d{5}\.", tok.decode(row[start:end]))
