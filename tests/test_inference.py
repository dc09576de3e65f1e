"""Inference: the KV cache against the full forward, generation, sampling, perplexity, and transformers as reference."""

import math

import pytest
import torch

from agora.config import load_manifest
from agora.hf import export_state_dict, hf_config_kwargs
from agora.inference import Decoder, generate, perplexity, sample_next
from agora.model import KVCache, PipelineModel, Stage
from agora.wire import compress, decompress

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny(mode="subspace", stages=(1, 2, 1)):
    changes = {"residual.mode": mode, "stages": list(stages), "model.n_layers": sum(stages)}
    if mode == "dense":
        changes["residual.k"] = None
    return load_manifest("tiny").with_overrides(**changes)


def random_tokens(man, shape, seed=0):
    return torch.randint(0, man.model.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def sharpen(model, factor=5.0):
    """Scale the weights up from the 0.02 init: attention and logits stop being near-uniform, so positions matter
    to the greedy choice and choices are not near-ties."""
    with torch.no_grad():
        for stage in model.stages:
            for name, p in stage.named_parameters():
                if name.endswith(("proj.weight", "lm_head.weight", "embed_tokens.weight")):
                    p.mul_(factor)
    return model


def naive_greedy(model, prompt, n):
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt) :]


# --------------------------------------------------------------------------- KV cache


@pytest.mark.parametrize("mode", ["dense", "subspace"])
def test_cached_decoding_equals_full_forward(mode):
    """Prefill, a multi-token chunk after it, then single tokens up to seq_len: the logits equal one full forward.

    Stage by stage with a cache each, through the wire codec at the boundaries as on separate peers (subspace: only
    k coordinates and the token ids cross)."""
    man = tiny(mode)
    model = PipelineModel(man).eval()
    seq_len = man.model.seq_len
    tokens = random_tokens(man, (2, seq_len))
    with torch.no_grad():
        ref = model(tokens)
        caches = [KVCache.for_stage(s, batch_size=2) for s in model.stages]
        chunks = [(0, 40), (40, 48)] + [(p, p + 1) for p in range(48, seq_len)]
        got = []
        for a, b in chunks:
            x = tokens[:, a:b]
            for stage, cache in zip(model.stages, caches):
                if not stage.spec.is_head:
                    x = decompress(compress(x, tokens[:, a:b], stage.basis, "fp32"), stage.basis, stage.frozen_embed)
                x = stage(x, cache)
            got.append(model.stages[-1].logits(x))
        assert all(c.length == seq_len for c in caches)
        diff = (torch.cat(got, dim=1) - ref).abs().max().item()
        assert diff < 1e-5, diff
        with pytest.raises(ValueError, match="past seq_len"):
            model.stages[0](tokens[:, :1], caches[0])


def test_cache_size_rollback_and_misuse():
    man = tiny("dense")
    model = PipelineModel(man).eval()
    head = model.stages[0]
    cache = KVCache.for_stage(head, batch_size=2, capacity=10)
    shape = man.model
    expected = 2 * len(head.layers) * 2 * shape.n_kv_heads * 10 * shape.head_dim * 4  # k and v, fp32
    assert cache.nbytes == expected == KVCache.nbytes_for(shape, len(head.layers), 2, 10)
    tokens = random_tokens(man, (2, 10))
    with torch.no_grad():
        head(tokens[:, :6], cache)
        with pytest.raises(ValueError, match="holds 2 sequences"):
            head(tokens[:1, 6:7], cache)
        with pytest.raises(ValueError, match="KV cache is full"):
            head(tokens[:, :5], cache)
        with pytest.raises(ValueError, match="layers"):
            model.stages[1](torch.zeros(2, 1, shape.d_model), cache)
        assert cache.length == 6  # refused calls leave the cache as it was
        # Rolling back and re-feeding gives the same output as the first time.
        first = head(tokens[:, 6:8], cache)
        cache.truncate(6)
        assert torch.equal(head(tokens[:, 6:8], cache), first)
    with pytest.raises(RuntimeError, match="no_grad"):
        head(tokens[:, 8:9], cache)
    with pytest.raises(ValueError, match="seq_len"):
        KVCache.for_stage(head, capacity=shape.seq_len + 1)


def test_decoder_rolls_back_every_stage_when_a_later_stage_fails():
    man = tiny("subspace")
    model = PipelineModel(man).eval()
    tokens = random_tokens(man, (1, 12))
    dec = Decoder(model)
    dec.step(tokens[:, :8])
    fail = model.stages[1].layers["2"].register_forward_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        dec.step(tokens[:, 8:10])
    fail.remove()
    assert [c.length for c in dec.caches] == [8, 8, 8]
    fresh = Decoder(model)
    fresh.step(tokens[:, :8])
    assert torch.equal(dec.step(tokens[:, 8:10]), fresh.step(tokens[:, 8:10]))


# --------------------------------------------------------------------------- generation and sampling


@pytest.mark.parametrize("mode", ["dense", "subspace"])
def test_greedy_generate_equals_naive_full_forward_loop(mode):
    man = tiny(mode)
    model = sharpen(PipelineModel(man).eval())
    prompt = random_tokens(man, (7,), seed=1).tolist()
    want = naive_greedy(model, prompt, 16)
    assert generate(model, prompt, 16) == want
    assert generate(list(model.stages), torch.tensor(prompt), 16) == want  # a list of stages, a tensor prompt
    assert generate(model, prompt, 16, eos_id=want[3]) == want[: want.index(want[3]) + 1]
    assert generate(model, prompt, 0) == []


def test_seeded_sampling_is_reproducible_and_tiny_top_p_is_greedy():
    man = tiny("dense")
    model = PipelineModel(man).eval()
    prompt = random_tokens(man, (5,), seed=2).tolist()
    a = generate(model, prompt, 12, temperature=1.0, seed=7)
    assert a == generate(model, prompt, 12, temperature=1.0, seed=7)
    assert a != generate(model, prompt, 12, temperature=1.0, seed=8)  # 4096 near-uniform tokens: never equal
    assert generate(model, prompt, 12, temperature=1.0, top_p=1e-6, seed=7) == generate(model, prompt, 12)


def test_sample_next_respects_top_p():
    logits = torch.tensor([0.5, 0.3, 0.2, 0.0]).clamp_min(1e-30).log().repeat(4000, 1)
    gen = torch.Generator().manual_seed(0)
    # Mass 0.5 reaches top_p=0.5 with the first token alone; 0.6 needs the second too; 1.0 keeps all non-zero.
    assert set(sample_next(logits, 1.0, 0.5, gen).tolist()) == {0}
    two = sample_next(logits, 1.0, 0.6, gen)
    assert set(two.tolist()) == {0, 1} and abs((two == 0).float().mean().item() - 0.5 / 0.8) < 0.03
    assert set(sample_next(logits, 1.0, 1.0, gen).tolist()) == {0, 1, 2}
    assert sample_next(logits[:3], 0.0).tolist() == [0, 0, 0]  # greedy, shape [B]
    assert sample_next(logits[0], 2.0, 1.0, gen).shape == ()


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(prompt_ids=list(range(65)), max_new_tokens=1), "more than the model's seq_len 64"),
        (dict(prompt_ids=list(range(60)), max_new_tokens=5), "at most 4 new tokens fit"),
        (dict(prompt_ids=[], max_new_tokens=1), "prompt is empty"),
        (dict(prompt_ids=[1, 2], max_new_tokens=-1), "max_new_tokens must be an integer >= 0"),
        (dict(prompt_ids=[1, 2], max_new_tokens=1, temperature=-0.5), "temperature must be"),
        (dict(prompt_ids=[1, 2], max_new_tokens=1, temperature=math.nan), "temperature must be"),
        (dict(prompt_ids=[1, 2], max_new_tokens=1, top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(prompt_ids=[1, 2], max_new_tokens=1, top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(prompt_ids=[1, 4096], max_new_tokens=1), r"prompt token ids must lie in \[0, 4096\)"),
        (dict(prompt_ids=[1, 2], max_new_tokens=1, eos_id=-1), "eos_id"),
    ],
)
def test_generate_refuses_bad_input(kwargs, needle):
    model = PipelineModel(tiny("dense", stages=(1, 1)))
    with pytest.raises(ValueError, match=needle):
        generate(model, **kwargs)


def test_generate_refuses_an_incomplete_model():
    man = tiny("dense")
    with pytest.raises(ValueError, match="every stage"):
        generate([Stage(man, 0), Stage(man, 2)], [1, 2], 1)


# --------------------------------------------------------------------------- perplexity


def test_perplexity_counts_windows_and_refuses_bad_input():
    man = tiny("subspace")
    model = PipelineModel(man)
    stream = random_tokens(man, (2 * 32 + 9,), seed=3)
    seen = []
    out = perplexity(model, stream, seq_len=32, batch_size=1, progress=lambda d, t: seen.append((d, t)))
    assert (out["tokens"], out["windows"]) == (2 * 31 + 8, 3)
    assert seen == [(31, 70), (62, 70), (70, 70)]
    assert model.training  # the caller's mode is restored
    # Random weights predict a random stream at about uniform: loss ~ ln(vocab).
    assert abs(out["loss"] - math.log(man.model.vocab_size)) < 0.1 and out["perplexity"] == math.exp(out["loss"])
    assert perplexity(model, stream, seq_len=32, max_tokens=33)["tokens"] == 31  # a 1-token remainder is dropped
    for kwargs, needle in [
        (dict(seq_len=65), "seq_len must be in"),
        (dict(seq_len=1), "seq_len must be in"),
        (dict(seq_len=32, batch_size=0), "batch_size"),
        (dict(seq_len=32, max_tokens=1), "max_tokens"),
    ]:
        with pytest.raises(ValueError, match=needle):
            perplexity(model, stream, **kwargs)
    with pytest.raises(ValueError, match="1-D integer"):
        perplexity(model, stream.float(), seq_len=32)


# --------------------------------------------------------------------------- transformers as the reference


@pytest.fixture(scope="module")
def hf_pair():
    transformers = pytest.importorskip("transformers")
    man = tiny("dense", stages=(2, 2))
    ours = sharpen(PipelineModel(man).eval())
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config_kwargs(man))).eval()
    missing, unexpected = hf.load_state_dict(export_state_dict(ours), strict=False)
    assert not unexpected and all(k.endswith("inv_freq") for k in missing), (missing, unexpected)
    return man, ours, hf


def test_greedy_generate_matches_transformers(hf_pair):
    man, ours, hf = hf_pair
    prompt = random_tokens(man, (9,), seed=4)
    hf.generation_config.eos_token_id = None  # run the full length, as ours does without eos_id
    with torch.no_grad():
        ref = hf.generate(prompt[None], max_new_tokens=40, do_sample=False, pad_token_id=0)[0, 9:].tolist()
    assert len(ref) == 40
    assert generate(ours, prompt, 40) == ref


def test_perplexity_matches_transformers_loss(hf_pair):
    man, ours, hf = hf_pair
    stream = random_tokens(man, (3 * 48 + 20,), seed=5)
    got = perplexity(ours, stream, seq_len=48, batch_size=2)
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, stream.numel(), 48):
            window = stream[start : start + 48][None]
            n = window.shape[1] - 1
            total += hf(window, labels=window).loss.item() * n
            count += n
    assert got["tokens"] == count == 3 * 47 + 19
    assert abs(got["loss"] - total / count) / (total / count) < 1e-5, (got["loss"], total / count)
