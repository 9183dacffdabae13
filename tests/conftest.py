"""Shared pytest fixtures of tests/ (as vLLM's conftest gives its tests `vllm_runner` and `hf_runner`).

- `llm`: the test module's tiny engine, shared by its tests, and `fresh_llm`: a new one for each test. Both are
  `engine_helpers.LLM(tiny_dir(LLM_ARCH), **LLM_ARGS)` from the module's globals (LLM_ARCH defaults to "qwen3";
  LLM_ARGS is required), and are exited after use.
- `model_dir`: a folder with the course's small trained tokenizer, the model the fake serving engine loads
  (serve_fake_engine.py); read-only, one per session. A module that needs another model defines its own.
- `fake_server`: start `python -m nanovllm_ref serve` with the fake engine on a free port
  (`fake_server(fake_kwargs, args)` -> serve_helpers.ServerProcess); every server it started is killed after
  the test.
- The mutation tests' `passes` / `fails` / `stub` are plain functions in course_checks.py.

The suite's machinery (areas, the notebook-run recorder, the chapter timings report, TRITON_INTERPRET on a CPU)
is tests/suite_plugin.py, loaded by the repository's conftest.py for every run. The grading of notebooks under
`pytest --nbval` and the skip of `gpu` cells without CUDA are the course's plugin (nanovllm_course/nbval_grading.py,
an entry point of the package).
"""
import pytest


def _module_llm(request):
    from engine_helpers import LLM, tiny_dir
    args = getattr(request.module, "LLM_ARGS", None)
    if args is None:
        pytest.fail(f"{request.module.__name__} uses the llm fixture but defines no LLM_ARGS (engine arguments)")
    return LLM(tiny_dir(getattr(request.module, "LLM_ARCH", "qwen3")), **args)


@pytest.fixture(scope="module")
def llm(request):
    engine = _module_llm(request)
    yield engine
    engine.exit()


@pytest.fixture
def fresh_llm(request):
    engine = _module_llm(request)
    yield engine
    engine.exit()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    from serve_helpers import make_tokenizer_dir
    return make_tokenizer_dir(tmp_path_factory.mktemp("serve_tok"))


@pytest.fixture
def fake_server(tmp_path, model_dir):
    from serve_helpers import ServerProcess
    started = []

    def start(fake_kwargs=None, args=(), **kwargs):
        server = ServerProcess(tmp_path, model_dir, fake_kwargs, args=args, **kwargs)
        started.append(server)
        return server
    yield start
    for server in started:
        server.kill()
