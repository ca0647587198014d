"""The model a plan is for: a shipped config name, a config.json, or a Hub-layout folder (its config.json
only is read; no weight, no network)."""

from __future__ import annotations

from typing import Any

from moetune.bench.models import config_path, short_name, with_layers
from moetune.models.registry import FAMILIES, family_for


def resolve_model(spec: str, *, layers: int | None = None) -> tuple[str, Any]:
    """(short name, config) of ``spec``, cut to its first ``layers`` layers when given. Model types
    moetune reads under another name (Kimi-K2's ``kimi_k2``) get Transformers' own config class."""
    from moetune.auto import _load_config

    path = config_path(spec, what="model")
    try:
        config = _load_config(path, trust_remote_code=False, overrides={})
    except (ValueError, FileNotFoundError) as error:
        raise ValueError(f"model {spec!r}: {error}") from error
    if family_for(config) is None:
        raise ValueError(
            f"model {spec!r}: moetune plan sizes the architectures moetune implements ({', '.join(FAMILIES)}), "
            f"got model_type {getattr(config, 'model_type', None)!r}"
        )
    with_layers(config, layers)
    config.use_cache = False
    return short_name(path), config
