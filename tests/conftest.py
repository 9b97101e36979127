import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from helpers import make_hf_model  # noqa: E402

VARIANTS = {
    # name: (family, kwargs)
    "llama": ("llama", dict(kv_heads=2)),                                   # GQA
    "llama3rope": ("llama", dict(kv_heads=4, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                           "original_max_position_embeddings": 16})),
    "qwen2": ("qwen2", dict(kv_heads=2)),                                   # qkv bias, tied embeddings
    "mistral": ("mistral", dict(kv_heads=1)),
}


# every per-user location the package and its apps read or write: the fetched models and kept sources
# (specbeam_edge.fetch), the engine's measurement cache (invariance.py), the chat app's conversations
# (apps/chat/store.py) and the translate tool's checksum cache (apps/translate/fingerprint.py)
USER_FOLDERS = {"SPECBEAM_DATA_DIR": "data", "SPECBEAM_CACHE_DIR": "cache", "SPECBEAM_CHAT_DB": "chat/chat.sqlite",
                "XDG_CACHE_HOME": "xdg_cache"}


def pytest_terminal_summary(terminalreporter):
    """Say how often speculative == plain let a difference through at a tie (helpers.TIES), so the allowance is
    counted where everyone sees it, not silent."""
    import helpers

    if helpers.TIES:
        terminalreporter.write_line(f"speculative == plain: {len(helpers.TIES)} difference(s) allowed at a tie "
                                    f"(at most {helpers.MAX_TIES_PER_TEST} a test):")
        for test, step, rank, gap in helpers.TIES:
            terminalreporter.write_line(f"  {test}: step {step}, rank {rank}, plain's gap {gap:.2g}")


@pytest.fixture(scope="session", autouse=True)
def _private_folders(tmp_path_factory):
    """Every per-user folder in this test session's temporary folder, never the user's: a test that read the real
    data folder failed once a model had been fetched, and others would have written into it. Set in os.environ, so
    the commands the tests start as subprocesses inherit them; a test that needs another sets its own."""
    import os

    base = tmp_path_factory.mktemp("user")
    for name, rel in USER_FOLDERS.items():
        os.environ[name] = str(base / rel)
    # an Engine runs every session on one shared thread pool (model.share_threads), after which onnxruntime refuses
    # sessions with pools of their own, which tests make: a pool per session here (test_threads.py runs shared)
    os.environ["SPECBEAM_SHARED_POOL"] = "0"


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """Lazily built tiny random HF models: hf_models(name) -> (folder, torch model)."""
    base = tmp_path_factory.mktemp("hf")
    cache = {}

    def get(name, **extra):
        key = (name, tuple(sorted(extra.items())))
        if key not in cache:
            fam, kw = VARIANTS[name]
            folder = base / f"{name}_{len(cache)}"
            cache[key] = (folder, make_hf_model(folder, fam, **{**kw, **extra}))
        return cache[key]
    return get


@pytest.fixture(scope="session")
def exported(tmp_path_factory, hf_models):
    """exported(name, precision, layout, output, kv_cache=None, **model_kwargs) -> specbeam folder (cached per
    session)."""
    from export import export

    base = tmp_path_factory.mktemp("sb")
    cache = {}

    def get(name, precision="fp32", layout="whole", output="logits", kv_cache=None, **extra):
        key = (name, precision, layout, output, kv_cache, tuple(sorted(extra.items())))
        if key not in cache:
            src, _ = hf_models(name, **extra)
            cache[key] = export(src, base / f"{name}_{precision}_{layout}_{output}_{len(cache)}",
                                precision=precision, layout=layout, output=output, quiet=True, kv_cache=kv_cache)
        return cache[key]
    return get


@pytest.fixture(scope="session")
def pair(exported):
    """A tiny random target and an unrelated 1-layer draft of the same vocabulary (folder paths as strings)."""
    return str(exported("llama", std=0.3, seed=3)), str(exported("llama", std=0.3, seed=11, layers=1))


@pytest.fixture
def top_calls(monkeypatch):
    """Rows per `top()` call of each head kind, recorded while the test runs: {"Dense": [rows, ...], "TopK": [...]}
    (a Dense call is the Python top-k over full logit rows; a TopK call reads the graph's own)."""
    import specbeam_edge.execution.heads as heads

    calls = {"Dense": [], "TopK": []}
    for cls in (heads.DenseOutput, heads.TopKOutput):
        real = cls.top

        def spy(self, rows, width, real=real, name=cls.__name__):
            calls[name.removesuffix("Output")].append(len(rows))
            return real(self, rows, width)
        monkeypatch.setattr(cls, "top", spy)
    return calls
