"""What only the machine can tell about a configuration: does the model exist (a path,
or a repo id in the Hugging Face cache), its tokenizer and chat template, do the TLS
files, does the KV memory fit. It runs when the cluster starts."""

from __future__ import annotations

import os

from tessera.cluster.cluster_config import ClusterConfig, ConfigError


def check_environment(config: ClusterConfig) -> None:
    """What only this machine can tell: the model, tokenizer and chat template exist, the
    KV pool fits in memory."""
    import torch

    from tessera.workers.kv.kv_cache import available_memory
    from tessera.workers.model.loader import resolve_model_path
    from tessera.workers.model.sources import chat_template_text, resolve_tokenizer_path

    try:  # a repo id the cache lacks is downloaded here, where it can say so
        resolve_model_path(config.model, config.revision)
        if config.tokenizer is not None:
            resolve_tokenizer_path(config.tokenizer)
        if config.chat_template is not None:
            chat_template_text(config.chat_template)
    except (FileNotFoundError, ValueError) as error:
        raise ConfigError(str(error)) from None
    draft = config.draft_model
    if draft is not None and not draft.startswith("target"):
        try:
            resolve_model_path(draft)
        except (FileNotFoundError, ValueError) as error:
            raise ConfigError(f"draft_model: {error}") from None
    for name in ("kv_transfer_tls_cert", "kv_transfer_tls_key", "kv_transfer_tls_ca"):
        path = getattr(config, name)
        if path is not None and not os.path.isfile(path):
            raise ConfigError(f"{name}: no such file: {path!r}")
    if config.kv_cache_memory is not None:
        total = _machine_memory()
        if config.kv_cache_memory > total:
            raise ConfigError(
                f"kv_cache_memory: {config.kv_cache_memory} bytes per worker is more than "
                f"this machine's {total} bytes of memory"
            )
        if config.device == "cuda" and torch.cuda.is_available():
            gpu = available_memory(torch.device("cuda"))
            if config.kv_cache_memory > gpu:
                raise ConfigError(
                    f"kv_cache_memory: {config.kv_cache_memory} bytes per worker is more "
                    f"than the GPU's {gpu} free bytes"
                )


def _machine_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
