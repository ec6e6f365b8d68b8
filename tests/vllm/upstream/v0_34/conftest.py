"""What vLLM 0.34's tests fetched here need of its repository and of the hub.

Imports. Upstream, the scheduler tests and their helper ``tests/v1/core/utils.py`` import
``tests.v1.kv_connector.unit.utils`` (and one test ``tests.v1.core.test_prefix_caching``)
from vLLM's repository. Here ``tests`` is kvguard's package, so this conftest registers
those names in :data:`sys.modules` for the fetched copies, which stay unmodified:

- ``tests.v1.kv_connector.unit.utils``: ``kv_connector_unit_utils.py`` here;
- ``tests.v1.core.utils``: ``utils.py`` here (the tests import it as ``.utils``);
- ``tests.v1.core.test_prefix_caching``: ``test_prefix_caching.py`` here;

and the packages above them (``tests.v1``, ...) as empty packages. Only on vLLM 0.34:
the copies use its API; on another series this folder's tests are skipped
(tests/vllm/upstream/conftest.py) and none of them is imported here. Nor where they are
not fetched: tests/vllm/upstream/conftest.py then stops the collection, naming the
command that fetches them.

The hub. The helpers build every scheduler with ``ModelConfig(model=...)``, by default
``"facebook/opt-125m"``, of which the scheduler reads the config only (no weights, no
tokenizer). Offline (``HF_HUB_OFFLINE=1``) the hub answers from its cache: the autouse
fixture :func:`offline_opt_125m` points the cache at one holding that model's
config.json (:data:`OPT_125M_CONFIG`), for each test here. Tests naming another model
are skipped (``SKIPPED`` in tests/vllm/upstream/conftest.py).
"""

from __future__ import annotations

import importlib
import json
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import vllm

import tests
from kvguard.adapters.vllm._compat import series_of
from tests.vllm.upstream.conftest import not_fetched

_HERE = __name__.rsplit(".", 1)[0]  # "tests.vllm.upstream.v0_34"

# upstream name -> fetched copy (in import order: each may import the ones above it)
ALIASES = {
    "tests.v1.kv_connector.unit.utils": f"{_HERE}.kv_connector_unit_utils",
    "tests.v1.core.utils": f"{_HERE}.utils",
    "tests.v1.core.test_prefix_caching": f"{_HERE}.test_prefix_caching",
}


def _package(name: str) -> types.ModuleType:
    """The (empty) package ``name``, registered and bound in its parent."""
    module = sys.modules.get(name)
    if module is None:
        module = types.ModuleType(name)
        module.__path__ = []
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        setattr(_package(parent) if parent != tests.__name__ else tests, child, module)
    return module


def register_aliases() -> None:
    for alias, vendored in ALIASES.items():
        if alias in sys.modules:
            continue
        parent, _, child = alias.rpartition(".")
        module = importlib.import_module(vendored)
        sys.modules[alias] = module
        setattr(_package(parent), child, module)


if series_of(vllm.__version__) == "0.34" and not_fetched() is None:
    register_aliases()


# facebook/opt-125m's config.json as the Hugging Face hub serves it.
OPT_125M_CONFIG = {
    "_name_or_path": "facebook/opt-125m",
    "activation_dropout": 0.0,
    "activation_function": "relu",
    "architectures": ["OPTForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 2,
    "do_layer_norm_before": True,
    "dropout": 0.1,
    "eos_token_id": 2,
    "ffn_dim": 3072,
    "hidden_size": 768,
    "init_std": 0.02,
    "layerdrop": 0.0,
    "max_position_embeddings": 2048,
    "model_type": "opt",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "pad_token_id": 1,
    "prefix": "</s>",
    "torch_dtype": "float16",
    "transformers_version": "4.21.0.dev0",
    "use_cache": True,
    "vocab_size": 50272,
    "word_embed_proj_dim": 768,
}


@pytest.fixture(scope="session")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face hub cache holding facebook/opt-125m's config.json only."""
    root = tmp_path_factory.mktemp("hf-hub-cache")
    repo = root / "models--facebook--opt-125m"
    revision = "0" * 40
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    (snapshot / "config.json").write_text(json.dumps(OPT_125M_CONFIG, indent=2))
    return root


@pytest.fixture(autouse=True)
def offline_opt_125m(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hub cache is :func:`hub_cache` for the test (huggingface_hub reads the
    constant when called; the variable is for anything that reads the environment)."""
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
