"""benchmarks.recall: the MQAR generator is a pure function of its arguments and builds Zoology's layout, and the
answer check scores the query positions only."""

from __future__ import annotations

import pytest
import torch

from benchmarks.recall import IGNORE, mqar, recall_counts, recall_loss


def test_same_seed_same_sequences_other_seed_other_ones():
    a = mqar(8, 64, 8, 128, seed=3)
    b = mqar(8, 64, 8, 128, seed=3)
    c = mqar(8, 64, 8, 128, seed=4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


@pytest.mark.parametrize("noise", [True, False])
def test_layout_pairs_then_one_query_per_key(noise):
    n, length, pairs, vocab = 16, 70, 6, 100
    x, y = mqar(n, length, pairs, vocab, seed=1, noise=noise)
    assert x.shape == y.shape == (n, length) and x.dtype == torch.long
    keys, values = x[:, 0 : 2 * pairs : 2], x[:, 1 : 2 * pairs : 2]
    assert bool(((keys >= 1) & (keys < vocab // 2)).all() and ((values >= vocab // 2) & (values < vocab)).all())
    for row in range(n):
        assert len(set(keys[row].tolist())) == pairs and len(set(values[row].tolist())) == pairs
        scored = (y[row] != IGNORE).nonzero().flatten()
        assert scored.numel() == pairs and bool((scored >= 2 * pairs).all()) and bool((scored % 2 == 0).all())
        pair_of = dict(zip(keys[row].tolist(), values[row].tolist(), strict=True))
        # each query position holds a key of the context and its target is that key's value
        assert sorted(x[row, scored].tolist()) == sorted(pair_of)
        assert all(pair_of[int(x[row, t])] == int(y[row, t]) for t in scored)
        # outside its pair and its query no key appears (noise comes from the value half, or is 0)
        rest = torch.ones(length, dtype=torch.bool)
        rest[: 2 * pairs], rest[scored] = False, False
        other = x[row, rest]
        assert bool(((other >= vocab // 2) if noise else (other == 0)).all())


def test_queries_lean_towards_the_pairs():
    """Zoology's power law: most gaps are short, some are long."""
    _, y = mqar(400, 256, 4, 64, seed=0)
    gaps = ((y != IGNORE).nonzero()[:, 1] - 8) // 2
    assert float((gaps < 16).float().mean()) > 0.5 and int(gaps.max()) > 64


def test_answer_check_counts_query_positions_only():
    x, y = mqar(4, 32, 4, 64, seed=2)
    logits = torch.full((4, 32, 64), -5.0)
    right = y.clamp_min(0)
    logits.scatter_(2, right.unsqueeze(-1), 5.0)  # predicts the target everywhere a target exists
    assert recall_counts(logits, y) == (16, 16)
    # wrong predictions at unscored positions change nothing; one wrong answer costs one hit
    logits[:, 1, :] = 0.0
    logits[:, 1, 7] = 9.0
    assert recall_counts(logits, y) == (16, 16)
    t = int((y[0] != IGNORE).nonzero()[0, 0])
    logits[0, t] = 0.0
    logits[0, t, (int(y[0, t]) + 1) % 64] = 9.0
    assert recall_counts(logits, y) == (15, 16)
    assert float(recall_loss(logits, y)) > 0
    perfect = torch.full_like(logits, -30.0).scatter_(2, right.unsqueeze(-1), 30.0)
    assert float(recall_loss(perfect, y)) < 1e-6


def test_bad_arguments():
    with pytest.raises(ValueError, match="seq_len"):
        mqar(2, 31, 4, 64, seed=0)
    with pytest.raises(ValueError, match="seq_len"):
        mqar(2, 32, 9, 64, seed=0)
    with pytest.raises(ValueError, match="vocab"):
        mqar(2, 64, 8, 16, seed=0)


def test_negative_threads_is_one_usage_line(capsys):
    from benchmarks.recall import main

    with pytest.raises(SystemExit) as exc:
        main(["--threads", "-1"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--threads: expected an integer in [0," in err and "Traceback" not in err
