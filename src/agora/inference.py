"""Text generation and held-out perplexity on stages held in this process, using each stage's ``KVCache``.

Sampling is kept apart from the forward pass (``sample_next``, ``validate_generation``) so that a swarm client,
whose stages run on other machines, checks requests and samples by exactly the same rules as ``generate``.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from agora.model import KVCache, PipelineModel, Stage

Model = Union[Sequence[Stage], PipelineModel]


# --------------------------------------------------------------------------- checks shared with remote callers


def as_stages(model: Model) -> list[Stage]:
    """Every stage of one model, head to tail, or a ValueError saying what is missing."""
    stages = list(model.stages) if isinstance(model, PipelineModel) else list(model)
    if not stages:
        raise ValueError("no stages given: pass a PipelineModel or the list of every stage, head first")
    if not all(isinstance(s, Stage) for s in stages):
        raise TypeError(f"expected Stage objects, got {[type(s).__name__ for s in stages]}")
    n = stages[0].spec.n_stages
    indices = [s.spec.index for s in stages]
    if indices != list(range(n)):
        raise ValueError(f"need every stage of the model in order (0..{n - 1}), got stages {indices}")
    if len({s.manifest_hash for s in stages}) != 1:
        raise ValueError("the stages were built from different manifests")
    return stages


def validate_generation(
    prompt_len: int, max_new_tokens: int, seq_len: int, temperature: float = 0.0, top_p: float = 1.0
) -> None:
    """Raise a ValueError for a request that cannot run. The prompt and every new token must fit in seq_len."""
    check_sampling(temperature, top_p)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if prompt_len < 1:
        raise ValueError("the prompt is empty: generation needs at least one token to condition on")
    if prompt_len > seq_len:
        raise ValueError(f"the prompt has {prompt_len} tokens, more than the model's seq_len {seq_len}")
    if prompt_len + max_new_tokens > seq_len:
        raise ValueError(
            f"a prompt of {prompt_len} tokens plus max_new_tokens={max_new_tokens} needs "
            f"{prompt_len + max_new_tokens} positions, more than the model's seq_len {seq_len}: "
            f"at most {seq_len - prompt_len} new tokens fit after this prompt"
        )


def check_sampling(temperature: float, top_p: float) -> None:
    # `not (a <= x)` also catches NaN, which would otherwise sample garbage silently.
    if not (0.0 <= temperature < math.inf):
        raise ValueError(f"temperature must be a finite number >= 0 (0 means greedy), got {temperature!r}")
    if not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1] (1 keeps every token), got {top_p!r}")


# --------------------------------------------------------------------------- sampling


def sample_next(
    logits: Tensor, temperature: float = 0.0, top_p: float = 1.0, generator: Optional[torch.Generator] = None
) -> Tensor:
    """Next token ids from last-position logits [..., V]; returns a long tensor of shape [...].

    temperature 0: argmax (the first index on ties, as torch and transformers do). Otherwise softmax(logits / T),
    restricted to the nucleus: the most likely tokens, in order, until their mass reaches ``top_p`` (the token that
    crosses it is kept, so at least one token always is). Sampling runs on ``generator``'s device, so a CPU
    generator with the same seed draws the same tokens whatever device made the logits.
    """
    check_sampling(temperature, top_p)
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    if generator is not None:
        logits = logits.to(generator.device)
    probs = F.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:  # top_p == 1 skips the sort: rounding in the cumulative sum must not drop the tail
        sorted_p, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_p.cumsum(dim=-1) - sorted_p
        sorted_p = sorted_p.masked_fill(mass_before >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    flat = probs.reshape(-1, probs.shape[-1])  # multinomial renormalises the kept mass
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


# --------------------------------------------------------------------------- incremental forward on local stages


@contextmanager
def _eval_mode(stages: list[Stage]) -> Iterator[None]:
    modes = [s.training for s in stages]
    try:
        for s in stages:
            s.eval()
        yield
    finally:
        for s, mode in zip(stages, modes):
            s.train(mode)


def _device(stage: Stage) -> torch.device:
    return next(stage.parameters()).device


class Decoder:
    """Local stages with one KV cache each: feed the next positions of a batch of sequences, get their logits."""

    def __init__(self, model: Model, batch_size: int = 1, capacity: Optional[int] = None):
        self.stages = as_stages(model)
        self.caches = [KVCache.for_stage(s, batch_size, capacity) for s in self.stages]
        self.devices = [_device(s) for s in self.stages]

    @property
    def length(self) -> int:
        return self.caches[0].length

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    @torch.no_grad()
    def step(self, tokens: Tensor) -> Tensor:
        """Token ids [B, t] at positions ``length .. length+t-1`` -> logits [B, t, V] (the tail's dtype)."""
        start = self.length
        try:
            x = tokens
            for stage, cache, device in zip(self.stages, self.caches, self.devices):
                x = stage(x.to(device), cache)
            return self.stages[-1].logits(x)
        except BaseException:
            for cache in self.caches:  # a failure in a later stage must not leave the earlier ones ahead
                cache.truncate(start)
            raise


def _prompt_list(prompt_ids: list[int] | Tensor) -> list[int]:
    if isinstance(prompt_ids, Tensor):
        if prompt_ids.dim() == 2 and prompt_ids.shape[0] == 1:
            prompt_ids = prompt_ids[0]
        if prompt_ids.dim() != 1 or prompt_ids.is_floating_point() or prompt_ids.is_complex():
            raise ValueError(
                f"prompt_ids must be a 1-D integer tensor (or [1, P]), got {prompt_ids.dtype} {tuple(prompt_ids.shape)}"
            )
        return [int(i) for i in prompt_ids.tolist()]
    ids = list(prompt_ids)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError("prompt_ids must be token ids (ints)")
    return ids


def _check_ids(ids: Tensor | list[int], vocab_size: int, what: str) -> None:
    ids = torch.as_tensor(ids)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"{what} must lie in [0, {vocab_size}), got ids from {int(ids.min())} to {int(ids.max())}")


def generate(
    model: Model,
    prompt_ids: list[int] | Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: Optional[int] = None,
    eos_id: Optional[int] = None,
) -> list[int]:
    """The new tokens (not the prompt) that follow ``prompt_ids``; stops after ``eos_id`` (included) if given.

    The prompt is fed once (prefill), then one token per step through the KV caches. temperature 0 is greedy and
    ignores ``seed``; otherwise tokens are drawn by ``sample_next`` from a CPU generator seeded with ``seed`` (None:
    a fresh random seed). The prompt plus ``max_new_tokens`` must fit in the model's seq_len.
    """
    stages = as_stages(model)
    shape = stages[0].shape
    prompt = _prompt_list(prompt_ids)
    validate_generation(len(prompt), max_new_tokens, shape.seq_len, temperature, top_p)
    _check_ids(prompt, shape.vocab_size, "prompt token ids")
    if eos_id is not None and not 0 <= eos_id < shape.vocab_size:
        raise ValueError(f"eos_id must lie in [0, {shape.vocab_size}), got {eos_id}")
    if max_new_tokens == 0:
        return []
    generator = None
    if temperature > 0:
        generator = torch.Generator()
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
    # The last new token is never fed back, so the caches need one position less than prompt + new tokens.
    decoder = Decoder(stages, batch_size=1, capacity=len(prompt) + max_new_tokens - 1)
    out: list[int] = []
    with _eval_mode(stages):
        logits = decoder.step(torch.tensor([prompt]))[:, -1]
        while True:
            token = int(sample_next(logits, temperature, top_p, generator)[0])
            out.append(token)
            if token == eos_id or len(out) == max_new_tokens:
                return out
            logits = decoder.step(torch.tensor([[token]]))[:, -1]


# --------------------------------------------------------------------------- perplexity


def _logits(stages: list[Stage], tokens: Tensor) -> Tensor:
    x = tokens
    for stage in stages:
        x = stage(x.to(_device(stage)))
    return stages[-1].logits(x)


@torch.no_grad()
def perplexity(
    model: Model,
    tokens: Tensor,
    seq_len: int,
    batch_size: int = 8,
    max_tokens: Optional[int] = None,
    progress: Optional[Callable[[int, int], None]] = None,
) -> dict:
    """Mean next-token loss (nats/token) of a token stream, in non-overlapping windows.

    Which tokens count: the first ``max_tokens`` tokens of ``tokens`` (all when None) are cut into windows
    ``tokens[i*seq_len : (i+1)*seq_len]``; a shorter last window is used when it holds at least 2 tokens. In a
    window of n tokens, token j = 1..n-1 is predicted from tokens 0..j-1 of the same window only, so each window
    counts n - 1 predictions and its first token none. Per window this is exactly transformers'
    ``model(window, labels=window).loss``; the mean here weights every counted token equally (total loss over
    total count, not a mean of window means). Runs in eval mode without gradients; the loss is taken from fp32
    logits whatever dtype the model computes in.

    Returns ``{"loss", "perplexity" (exp of loss), "tokens" (predictions counted), "windows", "seq_len"}``;
    ``progress(done, total)`` is called after each batch with predictions counted so far and in all.
    """
    stages = as_stages(model)
    shape = stages[0].shape
    if not isinstance(tokens, Tensor) or tokens.dim() != 1 or tokens.is_floating_point():
        raise ValueError("tokens must be a 1-D integer tensor (one token stream)")
    if not 2 <= seq_len <= shape.seq_len:
        raise ValueError(f"seq_len must be in [2, {shape.seq_len}] (the model's seq_len), got {seq_len}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_tokens is not None:
        if max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2 (one window of two tokens), got {max_tokens}")
        tokens = tokens[:max_tokens]
    if tokens.numel() < 2:
        raise ValueError(f"need at least 2 tokens to predict one, got {tokens.numel()}")
    _check_ids(tokens, shape.vocab_size, "token ids")

    tokens = tokens.long()
    n_full, rest = divmod(tokens.numel(), seq_len)
    full = tokens[: n_full * seq_len].view(n_full, seq_len)
    batches = [full[i : i + batch_size] for i in range(0, n_full, batch_size)]
    if rest >= 2:
        batches.append(tokens[n_full * seq_len :].view(1, rest))
    total = sum(b.numel() - b.shape[0] for b in batches)
    loss_sum, counted = 0.0, 0
    with _eval_mode(stages):
        for window in batches:
            logits = _logits(stages, window)[:, :-1].float()
            targets = window[:, 1:].to(logits.device)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
            loss_sum += float(loss)  # a Python float (double) accumulates across batches without fp32 drift
            counted += targets.numel()
            if progress is not None:
                progress(counted, total)
    mean = loss_sum / counted
    return {
        "loss": mean,
        "perplexity": math.exp(mean),
        "tokens": counted,
        "windows": sum(b.shape[0] for b in batches),
        "seq_len": seq_len,
    }
