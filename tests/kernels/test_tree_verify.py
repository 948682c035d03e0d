"""Tests of the tree verification references (kernels/tree_walk.py,
kernels/tree_rejection_sample.py): the greedy walk and multi-step speculative sampling on
hand-built trees, chains against the chain rules (greedy_verify, rejection_sample,
same noise), the vanished-residual rule, input checks, and the emitted tokens' distribution
(chi-square, >= 20,000 samples) for one-hot and full draft probabilities."""

from __future__ import annotations

import importlib
import itertools
import random
from typing import Any

import pytest
import torch
from _chi2 import chi2_pvalue

from specmesh.kernels.constants import PLACEHOLDER_TOKEN_ID
from specmesh.kernels.greedy_verify import greedy_verify_ref
from specmesh.kernels.rejection_sample import rejection_sample_ref
from specmesh.kernels.tree_layout import tree_node_depths
from specmesh.kernels.tree_rejection_sample import (
    tree_rejection_sample,
    tree_rejection_sample_noise,
    tree_rejection_sample_ref,
)
from specmesh.kernels.tree_walk import tree_walk, tree_walk_ref

# the modules (the package's attributes of these names are the launchers)
tw = importlib.import_module("specmesh.kernels.tree_walk")
trs = importlib.import_module("specmesh.kernels.tree_rejection_sample")

PH = PLACEHOLDER_TOKEN_ID
P_MIN = 1e-3


def _t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _cumsum(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int64).cumsum(0)


def _lists(result: tuple[torch.Tensor, ...]) -> list[list]:
    return [t.tolist() for t in result]


def random_parents(counts: list[int], rng: random.Random, chain_bias: float = 0.4) -> list[int]:
    """A random tree per request: node j's parent is j - 1 with probability ``chain_bias``,
    else uniform in [-1, j)."""
    parents: list[int] = []
    for k in counts:
        for j in range(k):
            parents.append(j - 1 if rng.random() < chain_bias else rng.randrange(-1, j))
    return parents


def make_tree_case(counts: list[int], vocab: int, full: bool, gen: torch.Generator,
                   rng: random.Random, dtype: torch.dtype = torch.float32, sharp: float = 1.0,
                   draft_from_target: float = 0.0, per_row: bool = True,
                   parents: list[int] | None = None) -> list[Any]:
    """Random trees with target rows ``softmax(sharp * randn)``; node c's token is drawn from its
    draft row, ``draft_from_target`` of its parent's target row mixed into a random row (the
    row is passed when ``full``); the arguments of :func:`tree_rejection_sample`."""
    total, batch = sum(counts), len(counts)
    parents = random_parents(counts, rng) if parents is None else parents
    target = torch.softmax(sharp * torch.randn(total + batch, vocab, generator=gen,
                                               dtype=torch.float64), dim=-1)
    own = torch.softmax(sharp * torch.randn(total, vocab, generator=gen, dtype=torch.float64),
                        dim=-1)
    req = torch.repeat_interleave(torch.arange(batch), torch.tensor(counts, dtype=torch.int64))
    parent_row = torch.tensor(parents, dtype=torch.int64) + 1 + \
        (_cumsum(counts) - torch.tensor(counts))[req] + req if total else req
    draft = (1 - draft_from_target) * own + draft_from_target * target[parent_row]
    drafts = (torch.multinomial(draft, 1, generator=gen)[:, 0] if total
              else torch.zeros(0, dtype=torch.int64))
    cu = _cumsum(counts)
    uniform, noise = tree_rejection_sample_noise(cu, vocab, dtype, gen, per_row=per_row)
    return [drafts, cu, _t(parents), draft.to(dtype) if full else None, target.to(dtype),
            uniform, noise]


def make_walk_case(counts: list[int], vocab: int, rng: random.Random,
                   parents: list[int] | None = None) -> list[torch.Tensor]:
    """Random trees whose target token per row is, with probability 0.7, the token of one of the
    row's children (so walks go deep and take later siblings); the arguments of
    :func:`tree_walk`."""
    parents = random_parents(counts, rng) if parents is None else parents
    drafts = [rng.randrange(vocab) for _ in parents]
    targets: list[int] = []
    start = 0
    for k in counts:
        for row in range(k + 1):
            kids = [drafts[start + j] for j in range(k) if parents[start + j] == row - 1]
            targets.append(rng.choice(kids) if kids and rng.random() < 0.7
                           else rng.randrange(vocab))
        start += k
    return [_t(drafts), _cumsum(counts), _t(parents), _t(targets)]


# --------------------------------------------------------------------------------------------
# Depths
# --------------------------------------------------------------------------------------------


def test_node_depths() -> None:
    # request 0: 0, 1 at depth 1; 2 under 1; 3 under 2; 4 under 0. request 1: empty.
    # request 2: a chain of 3.
    cu = _cumsum([5, 0, 3])
    parents = _t([-1, -1, 1, 2, 0, -1, 0, 1])
    assert tree_node_depths(cu, parents).tolist() == [1, 1, 2, 3, 2, 1, 2, 3]
    chain = _t(list(range(-1, 99)))
    assert tree_node_depths(_t([100]), chain).tolist() == list(range(1, 101))
    assert tree_node_depths(_t([0, 0]), _t([])).tolist() == []


# --------------------------------------------------------------------------------------------
# Greedy walk: hand cases
# --------------------------------------------------------------------------------------------


def test_walk_takes_the_branch_whose_token_is_the_target() -> None:
    # root children: node 0 (5), node 1 (3); node 2 (7) under 1; node 3 (2) under 0
    drafts, cu, parents = _t([5, 3, 7, 2]), _t([4]), _t([-1, -1, 1, 0])
    # rows: root, after 0, after 1, after 2, after 3
    out = tree_walk_ref(drafts, cu, parents, _t([3, 9, 7, 1, 4]))
    assert _lists(out) == [[[3, 7, 1]], [2], [[1, 2]]]  # 3 -> 7, extra: row after node 2
    out = tree_walk_ref(drafts, cu, parents, _t([5, 2, 0, 0, 6]))
    assert _lists(out) == [[[5, 2, 6]], [2], [[0, 3]]]  # leaf reached: bonus from its row
    out = tree_walk_ref(drafts, cu, parents, _t([5, 8, 7, 1, 4]))
    assert _lists(out) == [[[5, 8, PH]], [1], [[0, -1]]]  # node 0 has no child 8: recovered
    out = tree_walk_ref(drafts, cu, parents, _t([1, 8, 7, 1, 4]))
    assert _lists(out) == [[[1, PH, PH]], [0], [[-1, -1]]]


def test_walk_tries_siblings_in_node_order() -> None:
    # two root children with the same token 4: the first (node 0) wins, its subtree is followed
    drafts, cu, parents = _t([4, 4, 6, 6]), _t([4]), _t([-1, -1, 1, 0])
    out = tree_walk_ref(drafts, cu, parents, _t([4, 6, 6, 0, 2]))
    assert _lists(out) == [[[4, 6, 2]], [2], [[0, 3]]]
    # node order, not depth order: a later node under the root is still a root child
    drafts, cu, parents = _t([1, 2, 3]), _t([3]), _t([-1, 0, -1])
    out = tree_walk_ref(drafts, cu, parents, _t([3, 5, 5, 9]))
    assert _lists(out) == [[[3, 9, PH]], [1], [[2, -1]]]


def test_walk_ragged_batch_empty_trees_and_explicit_width() -> None:
    # request 0: no nodes; request 1: one node; request 2: empty; request 3: chain of 2
    drafts, cu, parents = _t([7, 1, 2]), _cumsum([0, 1, 0, 2]), _t([-1, -1, 0])
    targets = _t([4, 7, 8, 5, 1, 2, 3])
    out = tree_walk_ref(drafts, cu, parents, targets)
    assert _lists(out) == [[[4, PH, PH], [7, 8, PH], [5, PH, PH], [1, 2, 3]], [0, 1, 0, 2],
                           [[-1, -1], [0, -1], [-1, -1], [0, 1]]]
    wide = tree_walk_ref(drafts, cu, parents, targets, max_depth=4)
    assert wide[0].shape == (4, 5) and wide[2].shape == (4, 4)
    assert torch.equal(wide[0][:, :3], out[0]) and (wide[0][:, 3:] == PH).all()
    empty = tree_walk_ref(_t([]), _t([]), _t([]), _t([]))
    assert [tuple(t.shape) for t in empty] == [(0, 1), (0,), (0, 0)]
    no_nodes = tree_walk_ref(_t([]), _t([0, 0]), _t([]), _t([3, 4]))
    assert _lists(no_nodes) == [[[3], [4]], [0, 0], [[], []]]


@pytest.mark.parametrize("seed", range(4))
def test_chain_walk_is_greedy_verification(seed: int) -> None:
    rng = random.Random(seed)
    counts = [rng.randrange(0, 7) for _ in range(9)]
    parents = [j - 1 for k in counts for j in range(k)]
    drafts, cu, par, targets = make_walk_case(counts, 5, rng, parents)
    out, accept, nodes = tree_walk_ref(drafts, cu, par, targets)
    ref_out, ref_accept = greedy_verify_ref(drafts, cu, targets)
    assert torch.equal(out, ref_out) and torch.equal(accept, ref_accept)
    pos = torch.arange(nodes.shape[1])[None, :]
    assert torch.equal(nodes, torch.where(pos < accept[:, None], pos, -1))
    assert accept.sum() > 0


def _walk_oracle(args: list[torch.Tensor]) -> list[list[int]]:
    """The walk request by request, in plain Python."""
    drafts, cu, parents, targets = (a.tolist() for a in args)
    rows, start = [], 0
    for b, end in enumerate(cu):
        node, path = -1, []
        for j in range(end - start):
            row_target = targets[start + b + 1 + node]
            if parents[start + j] == node and drafts[start + j] == row_target:
                node = j
                path.append(j)
        rows.append(path + [targets[start + b + 1 + node]])
        start = end
    return rows


@pytest.mark.parametrize("seed", range(4))
def test_walk_matches_an_oracle_on_random_trees(seed: int) -> None:
    rng = random.Random(100 + seed)
    counts = [rng.randrange(0, 9) for _ in range(12)]
    args = make_walk_case(counts, 3, rng)
    out, accept, nodes = tree_walk_ref(*args)
    drafts = args[0].tolist()
    start = 0
    for b, (want, k) in enumerate(zip(_walk_oracle(args), counts)):
        path, extra = want[:-1], want[-1]
        assert accept[b] == len(path)
        assert nodes[b, :len(path)].tolist() == path
        assert out[b, :len(path) + 1].tolist() == [drafts[start + j] for j in path] + [extra]
        start += k
    assert (nodes >= 1).any()  # a later sibling was taken somewhere


# --------------------------------------------------------------------------------------------
# Stochastic rule: hand cases
# --------------------------------------------------------------------------------------------


def _noise(rows: list[list[float]], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype)


def test_second_sibling_is_tested_against_the_normalized_residual() -> None:
    # root row t = (0.5, 0.3, 0.2); one-hot children 0 then 1 (both root children)
    target = torch.tensor([[0.5, 0.3, 0.2], [1.0, 0, 0], [0, 1.0, 0]])
    args = [_t([0, 1]), _t([2]), _t([-1, -1]), None, target]
    noise = torch.ones(3, 3)

    def run(u0: float, u1: float) -> list[list]:
        u = torch.tensor([u0, u1], dtype=torch.float64)
        return _lists(tree_rejection_sample_ref(*args, u, noise))

    assert run(0.49, 0.99) == [[[0, 0]], [1], [[0]]]  # child 0 accepted, bonus from its row
    # child 0 rejected: r = (0, 0.6, 0.4); u1 = 0.55 < 0.6 accepts (0.55 >= t[1] = 0.3)
    assert run(0.51, 0.55) == [[[1, 1]], [1], [[1]]]
    # both rejected: the recovered token comes from r = (0, 0, 1)
    assert run(0.51, 0.65) == [[[2, PH]], [0], [[-1]]]


def test_full_draft_probs_residual_per_sibling() -> None:
    target = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6], [0.3, 0.3, 0.4]],
                          dtype=torch.float64)
    q = torch.tensor([[0.6, 0.2, 0.2], [0.2, 0.2, 0.6]], dtype=torch.float64)
    args = [_t([0, 2]), _t([2]), _t([-1, -1]), q, target]
    noise = torch.ones(3, 3, dtype=torch.float64)
    u = torch.tensor([0.83, 0.0], dtype=torch.float64)  # 0.83 * 0.6 < 0.5: accepted
    assert _lists(tree_rejection_sample_ref(*args, u, noise))[1] == [1]
    # child 0 rejected: r = normalize(max(t - q0, 0)) = (0, 1, 0); child 1 (token 2) has r = 0;
    # then r = normalize(max((0, 1, 0) - q1, 0)) = (0, 1, 0): recovered token 1
    u = torch.tensor([0.84, 0.0], dtype=torch.float64)
    assert _lists(tree_rejection_sample_ref(*args, u, noise)) == [[[1, PH]], [0], [[-1]]]


def test_vanished_residual_keeps_the_distribution_still_owed() -> None:
    # root t = (0.5, 0.25, 0.25); child 0 (token 0, q0 = (0.75, 0.25, 0)) rejected leaves
    # r = (0, 0, 1); child 1's q1 = (0, 0, 1) equals r and its token 1 (outside q1: rounding or
    # a bad drafter are the only ways) is rejected: max(r - q1, 0) vanishes, r stays (0, 0, 1).
    # Racing the target row instead would give token 0 with this noise.
    target = torch.tensor([[0.5, 0.25, 0.25], [0.2, 0.3, 0.5], [0.1, 0.1, 0.8]])
    q = torch.tensor([[0.75, 0.25, 0.0], [0.0, 0.0, 1.0]])
    u = torch.tensor([0.9, 0.1], dtype=torch.float64)
    noise = _noise([[0.1, 1.0, 1.0]] * 3)
    out = tree_rejection_sample_ref(_t([0, 1]), _t([2]), _t([-1, -1]), q, target, u, noise)
    assert _lists(out) == [[[2, PH]], [0], [[-1]]]
    # the first child's residual vanishing (r == q, a token outside both): the target row
    # itself, as rejection sampling
    target = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.5, 0.5, 0.0]])
    args = [_t([2]), _t([1]), q, target, torch.tensor([0.3], dtype=torch.float64),
            _noise([[1.0, 0.1, 1.0]])]
    out = tree_rejection_sample_ref(*args[:2], _t([-1]), *args[2:])
    assert _lists(out) == [[[1, PH]], [0], [[-1]]]
    assert out[0].tolist() == rejection_sample_ref(*args)[0].tolist()


def test_repeated_one_hot_sibling_is_never_accepted_twice() -> None:
    target = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5]])
    u = torch.tensor([0.7, 0.0], dtype=torch.float64)  # u = 0 accepts anything with r > 0
    out = tree_rejection_sample_ref(_t([1, 1]), _t([2]), _t([-1, -1]), None, target, u,
                                    torch.ones(1, 2))
    assert _lists(out) == [[[0, PH]], [0], [[-1]]]


def test_noise_row_of_the_stop_node() -> None:
    # per-row noise: the stop node's row is raced; per-request noise: the request's row
    target = torch.full((3, 4), 0.25)
    u = torch.tensor([0.0, 0.0], dtype=torch.float64)  # accept the chain 0 -> 1
    per_row = _noise([[1, 1, 1, 0.1], [1, 1, 0.1, 1], [1, 0.1, 1, 1]])
    args = [_t([0, 3]), _t([2]), _t([-1, 0]), None, target, u]
    assert tree_rejection_sample_ref(*args, per_row)[0].tolist() == [[0, 3, 1]]
    assert tree_rejection_sample_ref(*args, per_row[:1])[0].tolist() == [[0, 3, 3]]


@pytest.mark.parametrize("full", [False, True], ids=["one-hot", "full"])
def test_greedy_targets_make_the_rule_the_greedy_walk(full: bool) -> None:
    # one-hot target rows: accept iff the token is the row's argmax; residuals stay on it
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    counts = [rng.randrange(0, 8) for _ in range(10)]
    vocab = 4
    drafts, cu, parents, targets = make_walk_case(counts, vocab, rng)
    onehot = torch.nn.functional.one_hot(targets, vocab).float()
    q = torch.softmax(torch.randn(len(drafts), vocab, generator=gen), -1) if full else None
    uniform, noise = tree_rejection_sample_noise(cu, vocab, torch.float32, gen)
    out = tree_rejection_sample_ref(drafts, cu, parents, q, onehot, uniform, noise)
    want = tree_walk_ref(drafts, cu, parents, targets)
    assert all(torch.equal(a, b) for a, b in zip(out, want))
    assert want[1].sum() > 0


@pytest.mark.parametrize("full", [False, True], ids=["one-hot", "full"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chain_is_rejection_sampling_with_the_same_noise(full: bool, dtype: torch.dtype) -> None:
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        counts = [rng.randrange(0, 6) for _ in range(16)]
        chain = [j - 1 for k in counts for j in range(k)]
        drafts, cu, parents, q, target, uniform, noise = make_tree_case(
            counts, 20, full, gen, rng, dtype, sharp=4.0, draft_from_target=0.9, per_row=False,
            parents=chain)
        ref_out, ref_accept = rejection_sample_ref(drafts, cu, q, target, uniform, noise)
        out, accept, nodes = tree_rejection_sample_ref(drafts, cu, parents, q, target, uniform,
                                                       noise)
        assert torch.equal(out, ref_out) and torch.equal(accept, ref_accept)
        pos = torch.arange(nodes.shape[1])[None, :]
        assert torch.equal(nodes, torch.where(pos < accept[:, None], pos, -1))
        # one noise row per target row, each a copy of its request's row: the same output
        rows = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts) + 1)
        out_rows = tree_rejection_sample_ref(drafts, cu, parents, q, target, uniform,
                                             noise[rows])
        assert torch.equal(out_rows[0], ref_out)
        assert 0 < int(accept.sum()) < sum(counts)


def test_explicit_one_hot_rows_equal_no_draft_probs() -> None:
    rng = random.Random(8)
    gen = torch.Generator().manual_seed(8)
    counts = [rng.randrange(0, 9) for _ in range(12)]
    drafts, cu, parents, _, target, uniform, noise = make_tree_case(
        counts, 30, False, gen, rng, sharp=2.0, draft_from_target=0.8)
    rows = torch.nn.functional.one_hot(drafts, 30).to(target.dtype)
    a = tree_rejection_sample_ref(drafts, cu, parents, None, target, uniform, noise)
    b = tree_rejection_sample_ref(drafts, cu, parents, rows, target, uniform, noise)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert a[1].sum() > 0


def test_ragged_empty_trees_and_explicit_width() -> None:
    gen = torch.Generator().manual_seed(9)
    rng = random.Random(9)
    args = make_tree_case([0, 3, 0, 1], 11, True, gen, rng)
    out, accept, nodes = tree_rejection_sample_ref(*args, max_depth=5)
    assert out.shape == (4, 6) and nodes.shape == (4, 5)
    assert accept[0] == 0 and accept[2] == 0 and out[0, 0] >= 0 and (out[0, 1:] == PH).all()
    natural = tree_rejection_sample_ref(*args)
    width = natural[0].shape[1]
    assert torch.equal(out[:, :width], natural[0]) and (out[:, width:] == PH).all()
    empty = tree_rejection_sample_ref(_t([]), _t([]), _t([]), None, torch.zeros(0, 3),
                                      torch.zeros(0), torch.ones(0, 3))
    assert [tuple(t.shape) for t in empty] == [(0, 1), (0,), (0, 0)]


# --------------------------------------------------------------------------------------------
# Launchers on CPU, bad inputs
# --------------------------------------------------------------------------------------------


def test_launchers_on_cpu_run_the_references(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the Triton entry must not run on CPU")

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(tw, "tree_walk_triton", fail)
    monkeypatch.setattr(trs, "tree_rejection_sample_triton", fail)
    rng = random.Random(10)
    walk_args = make_walk_case([3, 0, 2], 4, rng)
    assert all(torch.equal(a, b) for a, b in zip(tree_walk(*walk_args),
                                                 tree_walk_ref(*walk_args)))
    args = make_tree_case([3, 0, 2], 4, True, torch.Generator().manual_seed(10), rng)
    assert all(torch.equal(a, b) for a, b in zip(tree_rejection_sample(*args),
                                                 tree_rejection_sample_ref(*args)))


def test_interpret_set_after_import_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    args = make_walk_case([2], 4, random.Random(11))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="before"):
        tree_walk(*args)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="CUDA"):
        tw.tree_walk_triton(*args)


def _bad_inputs() -> dict[str, tuple[Any, list[Any]]]:
    gen = torch.Generator().manual_seed(12)
    rng = random.Random(12)
    walk = make_walk_case([3, 2], 5, rng, parents=[-1, 0, 0, -1, 0])
    sample = make_tree_case([3, 2], 5, True, gen, rng, parents=[-1, 0, 0, -1, 0])
    bad: dict[str, tuple[Any, list[Any]]] = {}

    def add(name: str, index: int, value: Any) -> None:
        for op, base, i in (("walk", walk, index), ("sample", sample, index)):
            args = list(base)
            args[i] = value
            bad[f"{op}-{name}"] = (op, args)

    add("parents-int32", 2, _t([-1, 0, 0, -1, 0]).to(torch.int32))
    add("parents-2d", 2, _t([-1, 0, 0, -1, 0])[None])
    add("parents-length", 2, _t([-1, 0, 0, -1]))
    add("parents-list", 2, [-1, 0, 0, -1, 0])
    add("parent-not-earlier", 2, _t([-1, 1, 0, -1, 0]))
    add("parent-below-root", 2, _t([-1, 0, -2, -1, 0]))
    add("parent-in-another-request", 2, _t([-1, 0, 0, -1, 1]))  # request 1 has nodes 0, 1
    add("drafts-int32", 0, walk[0].to(torch.int32))
    add("cu-not-ending-at-total", 1, _t([3, 4]))
    for name, value in (("max-depth-too-small", 1), ("max-depth-negative", -1),
                        ("max-depth-bool", True), ("max-depth-float", 2.0)):
        bad[f"walk-{name}"] = ("walk", [*walk, value])
        bad[f"sample-{name}"] = ("sample", [*sample, value])
    bad["walk-targets-length"] = ("walk", [*walk[:3], walk[3][:-1]])
    noise = sample[6]
    for name, value in (("noise-rows", noise[:3]), ("noise-zero", torch.zeros_like(noise)),
                        ("noise-dtype", noise.double())):
        bad[f"sample-{name}"] = ("sample", [*sample[:6], value])
    bad["sample-uniform-one"] = ("sample", [*sample[:5], torch.ones(5, dtype=torch.float64),
                                            noise])
    bad["sample-draft-probs-rows"] = ("sample", [*sample[:3], sample[3][:4], *sample[4:]])
    return bad


BAD_INPUTS = _bad_inputs()


@pytest.mark.parametrize("case", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_inputs_raise_value_error(case: tuple[str, list[Any]]) -> None:
    op, args = case
    fns = (tree_walk_ref, tree_walk) if op == "walk" else \
        (tree_rejection_sample_ref, tree_rejection_sample)
    for fn in fns:
        with pytest.raises(ValueError):
            fn(*args)


# --------------------------------------------------------------------------------------------
# Distribution of the emitted tokens (chi-square)
# --------------------------------------------------------------------------------------------

VOCAB = 4
DEPTH = 3
#: TARGET[d][prev]: the target after ``d`` tokens, the last being ``prev`` (root token 0)
TARGET = [
    torch.tensor([[0.40, 0.30, 0.20, 0.10]] * VOCAB),
    torch.tensor([[0.10, 0.20, 0.30, 0.40], [0.50, 0.10, 0.10, 0.30],
                  [0.25, 0.25, 0.25, 0.25], [0.05, 0.05, 0.45, 0.45]]),
    torch.tensor([[0.70, 0.10, 0.10, 0.10], [0.10, 0.20, 0.60, 0.10],
                  [0.30, 0.40, 0.20, 0.10], [0.20, 0.20, 0.20, 0.40]]),
    torch.tensor([[0.10, 0.60, 0.20, 0.10], [0.40, 0.40, 0.10, 0.10],
                  [0.25, 0.25, 0.40, 0.10], [0.30, 0.10, 0.30, 0.30]]),
]
#: DRAFT[d][prev]: the draft distribution of a node at depth d + 1 under a ``prev`` token
DRAFT = [
    torch.tensor([[0.10, 0.20, 0.30, 0.40]] * VOCAB),
    torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.40, 0.40, 0.10, 0.10],
                  [0.10, 0.10, 0.40, 0.40], [0.30, 0.00, 0.30, 0.40]]),
    torch.tensor([[0.40, 0.20, 0.20, 0.20], [0.10, 0.30, 0.30, 0.30],
                  [0.20, 0.50, 0.20, 0.10], [0.60, 0.10, 0.00, 0.30]]),
]
#: root children 0, 1, 2; 3, 4 under 0; 5 under 1; 6 under 3 (depths 1, 1, 1, 2, 2, 2, 3)
PARENTS = [-1, -1, -1, 0, 0, 1, 3]
NODE_DEPTH = [1, 1, 1, 2, 2, 2, 3]
#: distinct tokens per sibling group, for the fixed (n-gram style) trees
FIXED_TOKENS = [1, 2, 0, 2, 3, 1, 0]


def _tree_batch(n: int, mode: str, seed: int, dtype: torch.dtype) -> tuple[list[Any], Any]:
    """``n`` requests with the PARENTS tree: node tokens drawn i.i.d. from DRAFT given the
    parent's token (or FIXED_TOKENS), target rows from TARGET along each node's path."""
    gen = torch.Generator().manual_seed(seed)
    k = len(PARENTS)
    tokens = torch.zeros(n, k, dtype=torch.int64)
    draft_rows = torch.zeros(n, k, VOCAB, dtype=torch.float64)
    target_rows = torch.zeros(n, k + 1, VOCAB, dtype=torch.float64)
    target_rows[:, 0] = TARGET[0][0].double()
    for j, (parent, depth) in enumerate(zip(PARENTS, NODE_DEPTH)):
        prev = torch.zeros(n, dtype=torch.int64) if parent < 0 else tokens[:, parent]
        draft_rows[:, j] = DRAFT[depth - 1][prev].double()
        if mode.startswith("fixed"):
            tokens[:, j] = FIXED_TOKENS[j]
            draft_rows[:, j] = torch.nn.functional.one_hot(tokens[:, j], VOCAB).double()
        else:
            tokens[:, j] = torch.multinomial(draft_rows[:, j], 1, generator=gen)[:, 0]
        target_rows[:, j + 1] = TARGET[depth][tokens[:, j]].double()
    cu = _cumsum([k] * n)
    uniform, noise = tree_rejection_sample_noise(cu, VOCAB, dtype, gen, per_row=seed % 2 == 0)
    full = mode in ("full", "full-float64", "fixed-full")
    args = [tokens.reshape(-1), cu, _t(PARENTS * n),
            draft_rows.reshape(-1, VOCAB).to(dtype) if full else None,
            target_rows.reshape(-1, VOCAB).to(dtype), uniform, noise]
    return args, gen


def _complete(out: torch.Tensor, accept: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The emitted tokens continued by the target (TARGET rows) to DEPTH + 1 tokens."""
    seq = out.clone()
    for d in range(1, DEPTH + 1):
        todo = accept < d  # position d was not emitted
        seq[todo, d] = torch.multinomial(TARGET[d][seq[todo, d - 1]].double(), 1,
                                         generator=gen)[:, 0]
    return seq


def _exact_joint(positions: tuple[int, ...]) -> dict[tuple[int, ...], float]:
    probs: dict[tuple[int, ...], float] = {}
    for z in itertools.product(range(VOCAB), repeat=DEPTH + 1):
        pr = float(TARGET[0][0, z[0]])
        for d in range(1, DEPTH + 1):
            pr *= float(TARGET[d][z[d - 1], z[d]])
        key = tuple(z[i] for i in positions)
        probs[key] = probs.get(key, 0.0) + pr
    return probs


def _pvalue(seq: torch.Tensor, positions: tuple[int, ...]) -> float:
    exact = _exact_joint(positions)
    keys = sorted(exact)
    index = {key: i for i, key in enumerate(keys)}
    counts = [0] * len(keys)
    for row in seq[:, list(positions)].tolist():
        counts[index[tuple(row)]] += 1
    return chi2_pvalue(counts, [exact[key] for key in keys])


@pytest.mark.parametrize("mode", ["full", "full-float64", "one-hot", "fixed-one-hot",
                                  "fixed-full"])
def test_emitted_tokens_follow_the_target(mode: str) -> None:
    """Tokens at each depth (and jointly), the emitted ones continued by the target, follow the
    target: siblings i.i.d. from DRAFT with their rows (full) or treated as one-hot, and fixed
    distinct siblings (one-hot, or their one-hot rows passed as draft_probs)."""
    dtype = torch.float64 if mode.endswith("float64") else torch.float32
    n = 24_000
    args, gen = _tree_batch(n, mode, seed=len(mode), dtype=dtype)
    out, accept, nodes = tree_rejection_sample_ref(*args)
    assert out.shape == (n, DEPTH + 1)
    assert ((out == PH) == (torch.arange(DEPTH + 1)[None, :] > accept[:, None])).all()
    seq = _complete(out, accept, gen)
    for positions in ((0,), (1,), (2,), (3,), (0, 1), (1, 2), (0, 1, 2)):
        p = _pvalue(seq, positions)
        assert p > P_MIN, (mode, positions, p)
    # the walk goes deep and through later siblings
    assert (accept == DEPTH).any()
    assert ((nodes[:, 0] == 1) | (nodes[:, 0] == 2)).any()
    assert torch.equal(torch.tensor(NODE_DEPTH)[nodes[:, 0].clamp(min=0)] * (nodes[:, 0] >= 0),
                       (accept >= 1).long())


def test_fixed_siblings_are_accepted_with_their_target_probability() -> None:
    """With distinct one-hot siblings (x0, x1, x2) at the root, sibling i is accepted with
    probability t[x_i] exactly (multi-step sampling loses nothing to earlier rejections)."""
    n = 24_000
    args, _ = _tree_batch(n, "fixed-one-hot", seed=3, dtype=torch.float32)
    _, accept, nodes = tree_rejection_sample_ref(*args)
    first = torch.where(accept >= 1, nodes[:, 0], 3)
    t = TARGET[0][0]
    probs = [float(t[FIXED_TOKENS[i]]) for i in range(3)]
    probs.append(1 - sum(probs))
    p = chi2_pvalue(torch.bincount(first, minlength=4).tolist(), probs)
    assert p > P_MIN, (torch.bincount(first).tolist(), probs)
