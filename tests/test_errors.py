"""Bad input gives an error that names the problem, and the engine keeps serving."""

from __future__ import annotations

import json
import shutil

import pytest

from specdec import LLM, InvalidRequestError, ModelLoadError, SamplingParams


@pytest.fixture
def copy_of(qwen3_dir, tmp_path):
    def make():
        return shutil.copytree(qwen3_dir, tmp_path / "model")
    return make


def test_missing_directory():
    with pytest.raises(ModelLoadError, match="no such path"):
        LLM("/nonexistent/model", device="cpu")


def test_missing_config(copy_of):
    path = copy_of()
    (path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(path, device="cpu")


def test_corrupt_weights(copy_of):
    path = copy_of()
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        LLM(path, device="cpu")


def test_pickle_only_weights(copy_of):
    path = copy_of()
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="safetensors only"):
        LLM(path, device="cpu")


def test_unsupported_architecture(copy_of):
    path = copy_of()
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["MistralForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        LLM(path, device="cpu")


def test_an_eagle3_head_served_as_a_model_is_refused_for_what_it_is(copy_of):
    path = copy_of()
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLMEagle3"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"EAGLE-3 draft head .*--speculator eagle3 --draft-model"):
        LLM(path, device="cpu")


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
])
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def test_bad_prompts_are_rejected_and_engine_keeps_serving(llm):
    good = [5, 6, 7]
    with pytest.raises(InvalidRequestError, match="out of range"):
        llm.generate([good, [5, 96000]], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="context"):
        llm.generate([1] * 256, SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=2))
    assert not llm.engine.has_work()  # nothing of a rejected batch was queued
    out = llm.generate(good, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3


def test_generation_stops_at_context_length(qwen3_dir):
    llm = LLM(qwen3_dir, device="cpu", kv_cache_tokens=512, block_size=4)
    out = llm.generate([3] * 250, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6
