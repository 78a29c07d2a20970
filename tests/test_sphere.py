"""tl_dynamics.sphere, the one kernel for clusters on the sphere: planted clusters found exactly,
labels against a union-find reference (chains, padding), batched labels equal single ones, and
merge events against their definition (distinct label pairs)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from tl_dynamics import particles, sphere, trajectories
from tl_dynamics.errors import TLDynamicsError
from tl_dynamics.particles import _observables


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def union_find(cos: torch.Tensor, eps: float, valid: list[bool] | None = None) -> list[int]:
    """Components of ``cos > 1 - eps`` among valid points, labelled by their smallest index;
    -1 for invalid points (the reference the kernel must equal)."""
    n = cos.shape[0]
    valid = valid or [True] * n
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for i, j in itertools.combinations(range(n), 2):
        if valid[i] and valid[j] and float(cos[i, j]) > 1 - eps:
            a, b = find(i), find(j)
            parent[max(a, b)] = min(a, b)
    return [find(i) if valid[i] else -1 for i in range(n)]


def planted(k: int, per: int, d: int, spread: float, seed: int) -> tuple[torch.Tensor, list[int]]:
    """``k`` clusters of ``per`` points (angle to the centre below ``spread``), shuffled; and the
    canonical labels they must get (each point: the smallest shuffled index of its cluster)."""
    g = gen(seed)
    rotation, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    if d >= k:  # orthogonal centres, randomly rotated
        centres = rotation[:k]
    else:  # the 8 corners of a cube (70.5 degrees apart at least), randomly rotated
        corners = torch.tensor(list(itertools.product((-1.0, 1.0), repeat=3)), dtype=torch.float64)
        centres = sphere.unit(corners[:k]) @ rotation
    noise = torch.randn(k, per, d, generator=g, dtype=torch.float64)
    noise = noise - (noise * centres[:, None]).sum(-1, keepdim=True) * centres[:, None]
    x = sphere.unit(
        centres[:, None]
        + math.tan(spread)
        * sphere.unit(noise)
        * torch.rand(k, per, 1, generator=g, dtype=torch.float64)
    )
    order = torch.randperm(k * per, generator=g)
    cluster = torch.arange(k).repeat_interleave(per)[order]
    first = {c: min(i for i in range(k * per) if int(cluster[i]) == c) for c in range(k)}
    return x.reshape(k * per, d)[order], [first[int(c)] for c in cluster]


@pytest.mark.parametrize("d", [3, 16, 64])
def test_planted_clusters_are_found_exactly(d):
    # points within 0.05 rad of their centre: pairs within 0.1 rad, cos > 0.995 = 1 - 0.005;
    # centres at least 70 degrees apart, so eps = 0.01 links every pair inside a cluster and
    # none across (checked below)
    x, expect = planted(k=8, per=6, d=d, spread=0.05, seed=d)
    cos = sphere.cosines(x)
    across = cos[torch.tensor(expect)[:, None] != torch.tensor(expect)[None, :]]
    assert float(across.max()) < 1 - 0.01
    labels = sphere.cluster_labels(cos, 0.01)
    assert labels.tolist() == expect and labels.dtype == torch.int64
    assert int(sphere.count_clusters(labels)) == 8
    assert float(sphere.close_fraction(cos, 0.01)) == pytest.approx(8 * 15 / (48 * 47 / 2))
    # the particles package gives the same answer on the states themselves
    assert _observables.cluster_labels(x, 0.01).tolist() == expect


def test_labels_match_union_find_on_random_graphs_with_chains_and_padding():
    for seed in range(20):
        g = gen(100 + seed)
        n = int(torch.randint(2, 24, (1,), generator=g))
        d = int(torch.randint(2, 5, (1,), generator=g))
        x = sphere.unit(torch.randn(n, d, generator=g, dtype=torch.float64))
        valid = (torch.rand(n, generator=g) > 0.2).tolist()
        cos = sphere.cosines(x)
        for eps in (0.01, 0.1, 0.5):
            assert sphere.cluster_labels(cos, eps).tolist() == union_find(cos, eps)
            masked = sphere.cluster_labels(cos, eps, torch.tensor(valid))
            assert masked.tolist() == union_find(cos, eps, valid)


def test_a_long_chain_is_one_cluster():
    """Diameter 63: min-label propagation with pointer jumping reaches the far end."""
    ang = torch.arange(64, dtype=torch.float64) * math.radians(5)
    x = torch.stack([torch.cos(ang), torch.sin(ang)], -1)[torch.randperm(64, generator=gen(1))]
    labels = sphere.cluster_labels(sphere.gram(x), 0.01)
    assert labels.unique().tolist() == [0] and int(sphere.count_clusters(labels)) == 1


def test_batched_labels_equal_single_ones():
    x = sphere.unit(torch.randn(3, 4, 10, 3, generator=gen(2), dtype=torch.float64))
    mask = torch.rand(3, 4, 10, generator=gen(3)) > 0.3
    cos = sphere.cosines(x)
    batched = sphere.cluster_labels(cos, 0.3, mask)
    assert batched.shape == (3, 4, 10)
    for i, j in itertools.product(range(3), range(4)):
        assert torch.equal(batched[i, j], sphere.cluster_labels(cos[i, j], 0.3, mask[i, j]))
    counts = sphere.count_clusters(batched)
    assert counts.shape == (3, 4)
    assert counts[0, 0] == len(set(batched[0, 0].tolist()) - {-1})


@pytest.mark.parametrize("tree_max", [0, sphere.TREE_MAX_POINTS])
def test_grid_on_both_plans_equals_union_find_slice_by_slice(tree_max, monkeypatch):
    """``cluster_labels_grid`` over prompts and thresholds where some (threshold, prompt) slices
    have no pair closer than the threshold (the CPU settles those from the closest pair alone)
    and others chain: every slice equals union-find, with and without a mask (the first points
    padding in one prompt), on the CPU's plan (read off a spanning tree, or propagated) and a
    GPU's."""
    from tl_dynamics.collect._policy import planned_as

    monkeypatch.setattr(sphere, "TREE_MAX_POINTS", tree_max)

    x = sphere.unit(torch.randn(4, 30, 16, generator=gen(4), dtype=torch.float64)).float()
    x[1, 3:] = x[1, 2]  # one clump of 28 points: links at every eps
    x[2, 5:9] = x[2, 4]  # a clump of 5 in a spread prompt
    cos = sphere.cosines(x)
    eps = (0.001, 0.02, 0.3, 1.5)  # 1 - 1.5 < 0: no shortcut on thresholds below zero
    left_padded = torch.rand(4, 30, generator=gen(5)) > 0.2
    left_padded[1, :4] = False
    for mask in (None, left_padded):
        for plan in (False, True):
            with planned_as(launch_bound=plan):
                grid = sphere.cluster_labels_grid(cos, eps, mask)
                grid_no_neg = sphere.cluster_labels_grid(cos, eps[:3], mask)
            for e, b in itertools.product(range(len(eps)), range(4)):
                valid = None if mask is None else mask[b].tolist()
                assert grid[e, b].tolist() == union_find(cos[b], eps[e], valid), (plan, e, b)
                if e < 3:
                    assert torch.equal(grid_no_neg[e, b], grid[e, b])
            if mask is None:  # both kinds of slice are exercised
                assert int(sphere.count_clusters(grid[0, 0])) == 30
                assert int(sphere.count_clusters(grid[0, 1])) == 3


def brute_events(before: list[int], after: list[int]) -> tuple[int, int]:
    pairs = {(a, b) for a, b in zip(before, after) if a >= 0}
    k_before = len({a for a in before if a >= 0})
    k_after = len({b for b in after if b >= 0})
    return len(pairs) - k_after, len(pairs) - k_before


def test_merge_events_are_one_type_and_follow_their_definition():
    before = torch.tensor([[0, 1, 2, 3, 4, -1], [0, 0, 0, 3, 3, -1]])
    after = torch.tensor([[0, 0, 2, 2, 4, -1], [0, 0, 2, 2, 4, -1]])
    events = sphere.merge_events(before, after)
    assert isinstance(events, sphere.MergeEvents)
    assert events.merges.dtype == events.splits.dtype == torch.int64
    # row 0: {0, 1} -> 0 and {2, 3} -> 2: two merges. Row 1: pairs (0,0), (0,2), (3,2), (3,4),
    # so D = 4 with 2 clusters before and 3 after: cluster 2 gathers 0 and 3 (one merge) while
    # 0 and 3 each split in two (two splits)
    assert events.merges.tolist() == [2, 1] and events.splits.tolist() == [0, 2]
    for seed in range(30):
        g = gen(200 + seed)
        a = torch.randint(0, 5, (12,), generator=g)
        b = torch.randint(0, 5, (12,), generator=g)
        a[torch.rand(12, generator=g) > 0.8] = -1
        a = torch.tensor(canon(a.tolist()))
        b = torch.tensor(canon(torch.where(a < 0, -1, b).tolist()))
        ev = sphere.merge_events(a, b)
        assert (int(ev.merges), int(ev.splits)) == brute_events(a.tolist(), b.tolist())
        assert int(ev.merges - ev.splits) == int(
            sphere.count_clusters(a) - sphere.count_clusters(b)
        )
    with pytest.raises(
        TLDynamicsError, match=r"two labellings of the same points, got shapes \(3,\) and \(4,\)"
    ):
        sphere.merge_events(torch.zeros(3, dtype=torch.long), torch.zeros(4, dtype=torch.long))


def canon(labels: list[int]) -> list[int]:
    """Any labelling made canonical (smallest index per label), -1 kept."""
    first: dict[int, int] = {}
    for i, lab in enumerate(labels):
        if lab >= 0:
            first.setdefault(lab, i)
    return [first[lab] if lab >= 0 else -1 for lab in labels]


def test_thresholds_have_distinct_names_and_the_packages_use_them():
    assert isinstance(sphere.CLUSTER_EPS, float) and sphere.CLUSTER_EPS == 0.01
    assert sphere.TRAJECTORY_EPS_GRID == (0.01, 0.05, 0.1, 0.25)
    assert not hasattr(particles, "DEFAULT_EPS") and not hasattr(trajectories, "DEFAULT_EPS")
    import inspect

    assert inspect.signature(particles.simulate).parameters["eps"].default == sphere.CLUSTER_EPS
    assert (
        inspect.signature(trajectories.compute).parameters["eps"].default
        == sphere.TRAJECTORY_EPS_GRID
    )
    with pytest.raises(TLDynamicsError, match=r"eps must be in \(0, 2\]"):
        sphere.cluster_labels(torch.eye(3), 0.0)
