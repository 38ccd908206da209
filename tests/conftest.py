"""Shared fixtures: one SmolLM2 load per session (ours and transformers'), reference outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tessera.workers.model.loader import builtin_model_path
from tessera.workers.quant.kernels import native_kernels
from tests.helpers import RAY_NAMESPACE, TransformersReference, save_random_llama, weights_digest

#: The session's shared loads, with their weights' digest when loaded (see below).
_SHARED_LOADS: list = []


@pytest.fixture(scope="session", autouse=True)
def _native_kernels_built_first() -> None:
    """Build the native extension (a first build takes ~60 s) before any test, so that
    no test's subprocess or Ray worker builds it inside that test's time limits."""
    native_kernels()


@pytest.fixture(scope="session")
def ray_session():
    """One real local Ray cluster (``num_cpus=2``, GPUs as detected) for the whole
    session, with the Serve settings of a Ray that `tessera serve` starts (HAProxy mode
    where it runs), so the HTTP and gRPC tests go through a user's front door;
    ``ray.shutdown`` stops the local cluster it started, nothing else."""
    import os

    import ray

    from tessera.cluster.server import local_ray_env

    for name, value in local_ray_env().items():
        os.environ.setdefault(name, value)

    ray.init(
        num_cpus=2,
        namespace=RAY_NAMESPACE,
        include_dashboard=False,
        object_store_memory=150 * 2**20,
        log_to_driver=False,
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return builtin_model_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """Our load of the built-in model, float32, shared by every engine in the session."""
    from tessera.workers.model.loader import load_model

    loaded = load_model(smollm2_path, "float32")
    _SHARED_LOADS.append((loaded, weights_digest(loaded.model)))
    return loaded


@pytest.fixture(scope="module", autouse=True)
def _shared_weights_unchanged(request):
    """After each test module: the session's shared model still has the weights it was
    loaded with. Every in-process engine of the session computes with them, so a stray
    write into them (a kernel out of bounds) would shift every later test's numbers
    while the Ray workers' own loads stayed right."""
    yield
    for loaded, digest in _SHARED_LOADS:
        assert weights_digest(loaded.model) == digest, (
            f"{request.module.__name__} changed the shared SmolLM2 load's weights"
        )


@pytest.fixture(scope="session")
def hf_reference(smollm2_path) -> TransformersReference:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name, dtype=torch.float32
    )
    model.eval()
    return TransformersReference(model)


@pytest.fixture
def make_engine(smollm2):
    """Build an engine over the session's model; pass EngineConfig fields as keywords."""
    from tessera.workers.config import EngineConfig
    from tessera.workers.engine.engine import Engine

    def make(**kwargs):
        kwargs.setdefault("num_kv_blocks", 256)
        return Engine(EngineConfig(**kwargs), loaded=smollm2)

    return make


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, smollm2):
    """A tiny random Llama (GQA, vocab 512) saved as a Hugging Face directory, with the
    transformers model that wrote it: (path, model)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    model = save_random_llama(path, smollm2.tokenizer)
    return path, model.eval()
