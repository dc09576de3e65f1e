"""Factored gossip DiLoCo's arithmetic (``agora.optim.gossip``) and its offline benchmark.

What must hold: mixing matrices are symmetric and doubly stochastic on any live graph (dead edges dropped,
Metropolis-Hastings weights); the exponential graph's rounds multiply to the exact average; the outer step without
gossip is DiLoCo's (the same arithmetic as the swarm's ``diloco`` scheme); blocking bytes are zero for q = 0 and
consensus tightens with q.
"""

import random

import torch

from agora.bench.gossip import GossipOptions, run
from agora.optim.gossip import (consensus_distance, exponential_edges, gossip_outer_step, metropolis_hastings,
                                mixing_error, ring_edges)
from agora.optim.outer import nesterov_outer_step


def test_mixing_matrices_stay_symmetric_and_doubly_stochastic_on_live_graphs():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 12)
        edges = [(i, j) for i in range(n) for j in range(i + 1, n) if rng.random() < 0.4]
        dead = [e for e in edges if rng.random() < 0.3]
        w = metropolis_hastings(n, edges, dead)
        assert torch.allclose(w, w.T, atol=0) and bool((w >= 0).all())
        assert torch.allclose(w.sum(0), torch.ones(n, dtype=torch.float64), atol=1e-12)
        assert torch.allclose(w.sum(1), torch.ones(n, dtype=torch.float64), atol=1e-12)
        for i, j in dead:  # a dead edge carries nothing
            assert w[i, j] == 0 and w[j, i] == 0
    # A replica cut off from everyone keeps its own parameters.
    assert torch.equal(metropolis_hastings(3, [(0, 1), (1, 2)], [(1, 2)])[2], torch.tensor([0, 0, 1.0],
                                                                                           dtype=torch.float64))


def test_the_exponential_graph_averages_exactly_in_log2_rounds_and_the_ring_contracts():
    n = 8
    product = torch.eye(n, dtype=torch.float64)
    for r in range(3):
        w = metropolis_hastings(n, exponential_edges(n, r))
        assert abs(mixing_error(w) - 1.0) < 1e-12  # one round alone leaves some disagreement untouched
        product = w @ product
    assert mixing_error(product) < 1e-12
    assert abs(mixing_error(metropolis_hastings(n, ring_edges(n))) - 0.8047) < 1e-3  # METHODS: 0.805
    assert torch.allclose(metropolis_hastings(n, ring_edges(n)).diagonal(), torch.full((n,), 1 / 3,
                                                                                        dtype=torch.float64))


def test_the_outer_step_without_gossip_is_dilocos_and_exact_mixing_with_agreement_too():
    torch.manual_seed(0)
    n, d = 4, 32
    start = torch.randn(d, dtype=torch.float64).expand(n, d).clone()
    end = start + 0.1 * torch.randn(n, d, dtype=torch.float64)
    momentum = torch.randn(d, dtype=torch.float64).expand(n, d).clone()
    exact, velocity = gossip_outer_step(start, end, momentum, None, 0.7, 0.9)
    want, want_v = nesterov_outer_step(start[0], momentum[0], end.mean(0), 0.7, 0.9)  # the swarm scheme's arithmetic
    assert torch.allclose(exact, want.expand(n, d), atol=1e-12) and torch.allclose(velocity, want_v.expand(n, d))
    assert consensus_distance(exact) < 1e-12
    # Gossip with the exact average as its mix, replicas agreeing on start and momentum: each replica still steps
    # on its own pseudo-gradient, so it ends where its own proposal puts it.
    full = torch.full((n, n), 1.0 / n, dtype=torch.float64)
    mixed, _ = gossip_outer_step(start, end, momentum, full, 0.7, 0.9)
    assert torch.allclose(mixed.mean(0), want, atol=1e-12)


def test_bench_gossip_counts_no_blocking_bytes_for_q0_and_tightens_with_q(tmp_path):
    opts = GossipOptions(replicas=8, dim=40, samples_per_replica=200, batch=16, inner_steps=5, rounds=12,
                         inner_lr=0.002, seeds=(0,), variants=("mix1", "q1", "q3", "q1_failures"))
    result = run(tmp_path, opts, log=lambda s: None)
    v = result["variants"]
    assert list(v) == ["diloco", "mix1", "q1", "q3", "q1_failures"]
    assert v["mix1"]["blocking_bytes_per_round_per_replica"]["median"] == 0
    assert v["mix1"]["background_bytes_per_round_per_replica"]["median"] == 2 * 4 * 40 * 4 / 8  # 4 pairs, both ways
    assert v["q1"]["blocking_bytes_per_round_per_replica"]["median"] == 2 * 4 * 40 * 8 / 8  # the ring's 8 edges
    assert v["q1_failures"]["blocking_bytes_per_round_per_replica"]["median"] < 2 * 4 * 40
    assert v["diloco"]["consensus"]["median"] < 1e-6
    assert result["consensus_decreasing_in_q"] is True
    assert v["mix1"]["loss_ratio"]["median"] > v["q3"]["loss_ratio"]["median"]
    assert (tmp_path / "result.json").exists() and "ratio to DiLoCo" in (tmp_path / "result.md").read_text()


def test_bench_gossip_command_line(tmp_path):
    from typer.testing import CliRunner

    from agora.cli import app

    runner = CliRunner()
    bad = runner.invoke(app, ["bench", "gossip", "--variants", "q2", "--out", str(tmp_path)])
    assert bad.exit_code == 2 and "unknown variants ['q2']" in bad.output
    ok = runner.invoke(app, ["bench", "gossip", "--dim", "20", "--rounds", "3", "--inner-steps", "2", "--seeds", "1",
                             "--variants", "q1", "--out", str(tmp_path)])
    assert ok.exit_code == 0, ok.output
    assert "| q1 |" in (tmp_path / "result.md").read_text()
