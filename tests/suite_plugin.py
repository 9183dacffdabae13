"""The test suite's own machinery (a pytest plugin; the repository's conftest.py loads it for every run here,
tests/ and the notebooks in solutions/ or chapters/ alike).

* **Areas.** Every test item carries exactly one area marker: `engine`, `kernels`, `serve`, `course` or `bench`
  (pyproject.toml registers them, with `slow`). A test file's area comes from its name (FILE_AREAS); a test
  marked with an area itself keeps its own. `make test-engine` and the like select one (`-m engine`);
  tests/test_suite_rules.py holds every item to one area.
* **Slow.** `slow` marks what `make test-fast` leaves out: the tests named in SLOW (measured) and any marked
  `@pytest.mark.slow` in their file.
* **One run of a notebook feeds grade and nbval.** With `--nbval-record=DIR`, for each notebook that
  `pytest --nbval` grades as a student's (nanovllm_course/nbval_grading.py), the outputs its kernel gave each
  cell (nbval's `item.test_outputs`) are put back into the notebook as its grading session prepared it, and
  `grade`'s verdict on that same run (grading.Session.grade_executed, in the process whose session signed the
  verdicts) is written with the nbval items' verdicts to `DIR/<stem>.json`, and the notebook as it ran to
  `DIR/<name>`: tests/test_course_machinery.py runs each chapter once filled and once unfilled this way, and
  holds `grade` and nbval to the same lines. `--nbval-compare-solution` also compares every cell that is not a
  check cell with the solution's stored output (nbval's own comparison; the grading compares only the cells the
  release keeps): a correct student's filled chapter must reproduce the solution's outputs.
* **xdist.** A notebook's items share one kernel, so they carry `xdist_group` (the notebook), and
  `make test` runs with `--dist loadgroup`: each notebook runs whole on one worker.
* **The chapter timings report.** At the end of a run the time each chapter took (its filled and its
  unfilled run in tests/test_course_machinery.py) is printed beside its CPU budget and written to artifacts/chapter_timings.csv and .json, with the load average and a calibration
  measured in the same run. A budget is a number in this report, never a test's pass or fail: a busy
  machine is slower, not wrong.
"""
from __future__ import annotations

import copy
import csv
import fnmatch
import json
import os
import sys
import time
from pathlib import Path

import pytest

# nbformat's validator imports jsonschema, whose optional IRI format checker (rfc3987_syntax) builds a Lark
# grammar at import: 1.2 s of CPU in every pytest process here (the main one, each xdist worker, each recorded
# notebook run) for a format that no notebook schema uses. Loaded before the nbval plugin (`-p tests.suite_plugin`,
# as make test and the recorded runs load it), this plugin leaves that checker out of the test processes.
sys.modules.setdefault("rfc3987_syntax", None)

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "artifacts"

# The Triton kernels run on a CPU only under the Triton interpreter, chosen before any kernel is defined.
# nanovllm_ref sets no environment variable itself, so the test session chooses it here (notebook kernels
# and tensor-parallel workers started by the tests inherit it).
# (A process started by this session finds the choice in its environment and need not import torch to make it.)
if "TRITON_INTERPRET" not in os.environ:
    import torch
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

AREAS = ("engine", "kernels", "serve", "course", "bench")

# (file name pattern, area): the first that matches a test file's name gives its tests' area.
FILE_AREAS = (
    ("test_serve_bench.py", "bench"),            # the online benchmark client
    ("test_fused_kernels_bench.py", "bench"),    # bench/kernels_round3.py
    ("test_course_ch13_gpu_script.py", "bench"),  # bench/ch13_gpu.py
    ("test_bench*.py", "bench"),
    ("test_serve_*.py", "serve"),
    ("test_course_*.py", "course"),
    ("test_release_*.py", "course"),
    ("test_suite_*.py", "course"),               # the suite's own rules
    ("test_packaging.py", "course"),             # the install routes agree
    ("browser_lab.py", "course"),
    ("*.ipynb", "course"),                       # the chapter notebooks under nbval
    ("test_triton_*.py", "kernels"),
    ("test_fused_kernels*.py", "kernels"),
    ("test_attention_backends.py", "kernels"),
    ("test_cpu_backend.py", "kernels"),
    ("test_engine_*.py", "engine"),
    ("test_sampler_*.py", "engine"),
    ("test_scheduler_*.py", "engine"),
    ("test_async_scheduling.py", "engine"),
    ("test_thin_step.py", "engine"),
    ("test_parts.py", "engine"),
    ("test_smollm2_*.py", "engine"),
    ("test_logprobs_close.py", "engine"),        # the bf16 equivalence rule the GPU checks apply
    ("test_workload_profile.py", "bench"),       # nanovllm_bench/workload_profile.py, the H200 profiler
)

# `slow`: what took 3 s or more on the 2-core CPU (measured 2026-12-01 under load, by test function): chapter
# runs, tensor-parallel workers, torch.compile warm-ups, servers and the real model. A file named here with "*"
# is slow throughout; a test may also carry @pytest.mark.slow itself.
SLOW = {
    "*.ipynb": "*", "browser_lab.py": "*",
    "test_serve_lifecycle.py": ("test_full_admission_queue_answers_503_at_once_and_recovers",
                                "test_sigterm_aborts_open_requests_calls_exit_and_exits_0",
                                "test_port_in_use_exits_1_before_the_engine_loads",
                                "test_a_served_model_name_holding_the_chunk_marks_streams_intact"),
    "test_serve_chat_shell.py": "*", "test_smollm2_engine.py": "*",
    "test_fused_kernels_bench.py": "*", "test_triton_engine.py": "*",
    "test_fused_kernels_persistent.py": "*",
    "test_async_scheduling.py": ("test_async_outputs_equal_sync_and_hf",),
    "test_engine_core_split.py": "*", "test_serve_faults.py": "*",
    "test_attention_backends.py": ("test_flash_adapter_maps_our_three_calls_onto_each_implementation",),
    "test_bench.py": ("test_a_missing_or_failing_peer_gets_a_row_with_the_reason_and_the_others_still_run",
                      "test_a_peer_past_its_time_limit_is_a_timeout_row",
                      "test_cpu_bench_records_median_min_max_load_and_equality_with_hf",
                      "test_cpu_tiny_honours_max_num_seqs_and_kvcache_block_size",
                      "test_cpu_tiny_mode_at_tensor_parallel_2_measures_against_two_devices_floor",
                      "test_cpu_tiny_mode_runs_every_peer_through_the_harness_and_writes_the_record",
                      "test_step_profile_at_tensor_parallel_2_times_whole_steps_over_gloo",
                      "test_the_bench_commands_forward_from_the_engine_cli",
                      "test_tp_comm_cpu_smoke_counts_one_decode_steps_collectives"),
    "test_course_ch13_gpu_script.py": ("test_cpu_smoke_writes_the_json_and_the_figure",),
    "test_course_ch12.py": ("test_hold_streams_keeps_every_stream_open_so_the_fifth_client_gets_503",),
    "test_course_ch13.py": ("test_c2_shows_both_engines_answers_and_their_throughput_on_this_cpu",
                            "test_chapter_10_a_stub_falls_back_to_chapter_04s_store_on_the_cpu_and_says_so",
                            "test_round_trip_every_part_is_yours_and_the_check_says_ok",
                            "test_the_capstone_table_names_each_part_its_owner_and_what_did_not_run",
                            "test_the_live_smollm2_reference_agrees_with_hf_scoring_its_ids",
                            "test_the_stream_sees_a_scheduler_that_requeues_at_the_back_and_e12_1_blames_it"),
    "test_course_engine_check.py": ("test_every_solution_part_runs_inside_the_engine",),
    "test_course_grading.py": ("test_chapter_09_cheats_fail_under_grade_and_pytest_nbval",
                               "test_one_command_grades_three_students_into_a_table_csv_and_json",
                               "test_pytest_nbval_names_each_students_notebook_and_agrees_with_grade",
                               "test_chapter_08_cheats_fail_under_grade", "test_chapter_09_cheats_fool_the_plain_check_cells",
                               "test_chapter_08_cheats_fool_the_plain_check_cells",
                               "test_a_your_part_cell_prints_one_line_and_returns_nothing",
                               "test_the_snapshot_puts_back_what_a_notebook_replaced"),
    "test_serve_cors.py": ("test_a_preflight_from_any_origin_is_allowed_by_default",       # (their servers start)
                           "test_the_flags_restrict_origins_methods_and_headers_and_allow_credentials"),
    "test_course_machinery.py": ("test_an_unfilled_chapter_fails_at_each_exercise_by_its_id_in_nbval_and_grade",
                                 "test_check_command_exit_status",
                                 "test_export_writes_beside_the_notebooks_and_two_graders_at_once_do_not_collide",
                                 "test_grade_reports_one_line_per_exercise",
                                 "test_a_correct_students_filled_chapter_passes_in_nbval_and_grade",
                                 "test_pytest_nbval_and_grade_agree_on_right_wrong_and_missing_answers"),
    "test_packaging.py": ("test_the_engine_imports_nothing_from_the_course_the_bench_or_the_checkpoint_tools",),
    "test_cpu_backend.py": ("test_engine_greedy_ids_equal_hf",),
    "test_engine_detokenizer.py": ("test_smollm2_text_keeps_the_contract_and_streams_the_same",),
    "test_engine_robustness.py": ("test_failed_tp_start_does_not_block_the_next_tp_engine",
                                  "test_tp1_engine_stays_correct_while_a_tp2_engine_is_alive"),
    "test_engine_stops.py": ("test_special_eos_text_shows_only_when_kept_and_not_skipped",),
    "test_engine_tp_and_errors.py": ("test_tensor_parallel_2_on_cpu_equals_tp_1_and_hf",
                                     "test_tp_engine_killed_mid_run_leaves_no_workers_and_next_engine_starts",
                                     "test_tp_step_interrupted_on_rank0_closes_the_engine_with_a_clear_error",
                                     "test_tp_step_that_raises_on_every_rank_reaches_the_caller_and_exit_still_finishes",
                                     "test_two_tp_engines_one_after_another_do_not_clash"),
    "test_fused_kernels_model.py": ("test_awkward_shape_on_triton_kernels_matches_hf",
                                    "test_bf16_kernels_stay_within_bf16_noise_of_the_model_without_them",
                                    "test_decode_batches_over_4_use_the_tl_dot_gemm_and_match_hf",
                                    "test_batches_over_max_m_run_cublas_gemms_with_the_norm_and_qk_kernels",
                                    "test_engine_on_triton_kernels_matches_hf_greedy",
                                    "test_engine_with_several_k_splits_matches_hf_greedy",
                                    "test_tensor_parallel_fused_decode_all_reduces_split_k_partials"),
    "test_parts.py": ("test_exported_parts_pickle_into_tensor_parallel_workers",
                      "test_exported_solutions_run_in_the_engine_with_hf_equal_ids",
                      "test_exported_unfilled_chapters_fall_back_to_the_reference_and_say_so",
                      "test_parts_from_an_importable_module_run_in_tensor_parallel_workers",
                      "test_triton_on_cpu_without_the_interpreter_is_refused_by_name"),
    "test_sampler_logprobs.py": ("test_tensor_parallel_prompt_and_completion_logprobs_equal_one_rank",),
    "test_sampler_penalties_min_p.py": ("test_greedy_with_penalties_equals_hf_generate",),
    "test_serve_api.py": ("test_a_long_prompt_is_tokenized_off_the_event_loop",
                          "test_completion_streamed_equals_non_streamed_and_the_engine_answer"),
    "test_serve_bench.py": ("test_client_runs_the_rates_against_the_fake_server_and_plots",
                            "test_overhead_measures_the_same_workload_offline_and_through_the_server"),
    "test_serve_real_engine.py": "*",
    "test_smollm2_convert.py": ("test_hf_greedy_generation_fp32_matches_reference_ids",),
    "test_thin_step.py": ("test_no_compile_after_start_up", "test_tensor_parallel_graph_path_on_cpu_equals_hf",
                          "test_without_warm_up_the_workload_compiles"),
    "test_triton_kernels.py": ("test_paged_prefill_with_cached_prefix_matches_reference",
                               "test_varlen_prefill_on_fused_qkv_views_matches_reference"),
}


# Tests that share an expensive module fixture, by file and function: `make test` hands each group to one worker
# (pytest_xdist_make_scheduler), so that the fixture runs once, not once on each worker that draws one of them.
TOGETHER = {
    "test_course_grading.py": {  # the module fixture graded_class: `grade` of the three students (~24 s of CPU)
        "test_one_command_grades_three_students_into_a_table_csv_and_json": "three_students",
        "test_pytest_nbval_names_each_students_notebook_and_agrees_with_grade": "three_students"},
}


def together_group(nodeid: str) -> str | None:
    """The TOGETHER group of a test's node id (`tests/test_x.py::test_f[...]`), as `tests/test_x.py::<group>`, or
    None."""
    path, _, rest = nodeid.partition("::")
    group = TOGETHER.get(path.rsplit("/", 1)[-1], {}).get(rest.split("[", 1)[0])
    return None if group is None else f"{path}::{group}"


def is_slow(file_name: str, function: str) -> bool:
    for pattern, tests in SLOW.items():
        if fnmatch.fnmatch(file_name, pattern) and (tests == "*" or function in tests):
            return True
    return False


def area_of_file(name: str) -> str | None:
    return next((area for pattern, area in FILE_AREAS if fnmatch.fnmatch(name, pattern)), None)


def pytest_addoption(parser):
    parser.getgroup("nbval").addoption(
        "--nbval-record", default=None, metavar="DIR",
        help="write each notebook's run (the notebook as it ran, and a JSON of grade's and nbval's verdicts) into "
             "DIR (tests/suite_plugin.py)")
    parser.getgroup("nbval").addoption(
        "--nbval-compare-solution", action="store_true",
        help="compare every non-check cell of a graded notebook with the solution's stored output "
             "(tests/suite_plugin.py)")


def pytest_configure(config):
    config.stash[_RUNS] = {}
    # the calibration is measured by the session that writes the report: not by workers, nor by the recorded
    # runs that tests start (--nbval-record)
    reporting = _is_controller(config) and not config.getoption("nbval_record")
    config.stash[_REPORT] = {"chapters": {}, "start": time.time(), "load_start": os.getloadavg(),
                             "calibration_s": [_calibrate()] if reporting else []}


def _is_controller(config) -> bool:
    return not hasattr(config, "workerinput")


# -- areas, slow, xdist groups -------------------------------------------------------------------------------
def _is_notebook_item(item) -> bool:
    return item.path is not None and item.path.suffix == ".ipynb"


def pytest_itemcollected(item):
    if not any(m.name in AREAS for m in item.iter_markers()):
        area = area_of_file(item.path.name)
        if area is not None:
            item.add_marker(area)
    if not item.get_closest_marker("slow") and is_slow(item.path.name, getattr(item, "originalname", item.name)):
        item.add_marker("slow")
    if _is_notebook_item(item) and item.config.pluginmanager.hasplugin("xdist"):
        item.add_marker(pytest.mark.xdist_group(_rel_path(item.path)))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup`, where a notebook's items are one group, and the longest work is handed out first.

    xdist's own grouping reads a node-id suffix that pytest 9's node ids no longer carry (xdist 3.8 sets
    `item._nodeid`), so a notebook is found by its path (xdist_group marks still group where the suffix is
    there, pytest 8). Work units go out longest first (LPT: the run ends when the last unit does, so a long one
    handed out last sets the tail): a chapter's notebook, and its unfilled run, weigh its CPU budget; a slow
    test 20 s; the rest 0, in collection order."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class NotebookGroupScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if path.endswith(".ipynb"):
                return path
            return together_group(nodeid) or super()._split_scope(nodeid)

        def schedule(self):
            # keep the workers' order (pytest_collection_modifyitems below puts the longest first); xdist would
            # sort by item count. (The order must be the workers' own: the controller sends them indices.)
            self.config.option.loadscopereorder = False
            super().schedule()

    return NotebookGroupScheduling(config, log)


def expected_seconds(item) -> float:
    """An item's weight for the order of a distributed run: an item of a chapter notebook, or a slow test of one
    chapter's filled or unfilled run (`..._filled_chapter_...[NN_slug.ipynb]`), the chapter's CPU budget; another
    slow test 20 s; any other 0."""
    import re
    name = item.path.name if item.path.suffix == ".ipynb" else (
        item.name if "filled_chapter" in item.name and item.get_closest_marker("slow") else "")
    m = re.search(r"(\d\d_[a-z0-9_]+\.ipynb)", name)
    if m:
        try:
            meta = json.loads((REPO / "solutions" / m.group(1)).read_text(encoding="utf-8"))["metadata"]
            return float(meta["nanovllm"]["cpu_budget_s"])
        except (OSError, KeyError, ValueError):
            return 20.0
    return 20.0 if item.get_closest_marker("slow") else 0.0


def pytest_collection_modifyitems(config, items):
    """--nbval-compare-solution (see the module doc); and on an xdist worker of `--dist loadgroup`, the longest work
    first (a stable sort, so a notebook's items stay together and in order; every worker sorts the same
    collection the same way)."""
    if config.getoption("nbval_compare_solution"):
        _compare_with_the_solution(items)
    # (xdist sets a worker's `dist` to "no" and keeps `loadgroup`)
    if hasattr(config, "workerinput") and getattr(config.option, "loadgroup", False):
        weights = {id(item): expected_seconds(item) for item in items}
        items.sort(key=lambda item: -weights[id(item)])


def _rel_path(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)


# -- recording a notebook's run --------------------------------------------------------------------------------
_RUNS = pytest.StashKey[dict]()
_REPORT = pytest.StashKey[dict]()


class NotebookRun:
    """What one `pytest --nbval` run of a notebook executed: the outputs of each code cell that ran, by its
    ordinal among the prepared notebook's code cells (nbval's `cell_num`), the nbval verdict of each exercise,
    and the seconds its items took."""

    def __init__(self, collector):
        self.collector = collector
        self.path = Path(collector.path)
        self.outputs: dict[int, list] = {}
        self.nbval: dict[str, str] = {}
        self.seconds = 0.0

    def executed(self):
        """(the notebook as its grading session prepared it, with each cell that ran as it ran; the indices of
        the cells that ran), or None when the notebook was not graded as a student's."""
        session = getattr(self.collector, "grading_session", None)
        if session is None or getattr(session, "prepared", None) is None:
            return None
        done = copy.deepcopy(session.prepared)
        code = [i for i, c in enumerate(done.cells) if c.cell_type == "code"]
        ran = []
        for k, outputs in self.outputs.items():
            cell = done.cells[code[k]]
            cell.outputs, cell.execution_count = copy.deepcopy(outputs), k + 1
            ran.append(code[k])
        return done, sorted(ran)

    def write(self, folder: Path) -> None:
        import nbformat
        executed = self.executed()
        record = {"notebook": str(self.path), "nbval": self.nbval, "seconds": self.seconds, "ran": None, "grade": None}
        if executed is not None:
            done, record["ran"] = executed
            grade = self.collector.grading_session.grade_executed(done, seconds=self.seconds)
            record["grade"] = {**grade.as_dict(), "lines": grade.lines()}
            (folder / self.path.name).write_text(nbformat.writes(done) + "\n", encoding="utf-8")
        (folder / f"{self.path.stem}.json").write_text(json.dumps(record, indent=1), encoding="utf-8")


def run_of(item) -> NotebookRun:
    runs = item.config.stash[_RUNS]
    key = str(Path(item.path).resolve())
    if key not in runs:
        runs[key] = NotebookRun(item.parent)
    return runs[key]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if not _is_notebook_item(item) or not item.config.getoption("nbval_record"):
        return report
    run = run_of(item)
    run.seconds += call.duration
    if call.when != "call":
        return report
    outputs = getattr(item, "test_outputs", None)
    if outputs is not None and getattr(item, "cell_num", None) is not None:
        run.outputs[item.cell_num] = outputs
    exercises = getattr(item, "exercises", None)
    if exercises:                    # a check item: its verdict lines, as pytest reports them
        lines = getattr(call.excinfo.value, "lines", None) if call.excinfo is not None else None
        if lines is None and report.outcome == "skipped" and hasattr(report, "wasxfail"):
            lines = report.wasxfail.split("; ")       # an optional exercise not ok: 'E4.3 not done yet (optional)'
        bad = {line.split(" ")[0]: line.removesuffix(" (optional)") for line in lines or []}
        for ex in exercises:
            run.nbval[ex] = bad.get(ex, f"{ex} ok")
    return report


def pytest_sessionfinish(session):
    folder = session.config.getoption("nbval_record")
    if not folder:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    for run in session.config.stash[_RUNS].values():
        run.write(Path(folder))


def _compare_with_the_solution(items) -> None:
    """--nbval-compare-solution: each item of a graded notebook that is no check cell compares its output with the
    solution's stored one (found by cell id), with the solution cell's nbval options."""
    from collections import defaultdict

    from nbval.plugin import find_comment_markers, find_metadata_tags

    from nanovllm_course.nbval_grading import reference_of
    solutions = {}
    for item in items:
        if not _is_notebook_item(item) or hasattr(item, "exercises") or getattr(item, "cell", None) is None:
            continue
        key = str(item.path)
        if key not in solutions:
            ref, _ = reference_of(item.path)
            solutions[key] = {c.get("id"): c for c in (ref.cells if ref is not None else []) if c.cell_type == "code"}
        ref = solutions[key].get(item.cell.get("id"))
        if ref is None or ref.get("execution_count") is None:
            continue
        item.cell.outputs = copy.deepcopy(ref.outputs)
        item.cell.execution_count = ref.execution_count
        options = defaultdict(bool, find_metadata_tags(ref.get("metadata", {})))
        options.update(dict(find_comment_markers(ref.source)))
        options.setdefault("check", True)
        item.options = options


# -- the chapter timings report ---------------------------------------------------------------------------------
def _calibrate() -> float:
    """Seconds of a fixed single-threaded workload (float32 matmuls and a Python loop): the same run's yardstick,
    so a chapter's time can be read as a multiple of it on any machine and load."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.randn(192, 192, generator=torch.Generator().manual_seed(0))
        start = time.perf_counter()
        for _ in range(200):
            a = torch.tanh(a @ a * 0.01)
        total = 0
        for k in range(300_000):
            total += k % 7
        return time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)


def pytest_runtest_logreport(report):
    config = _CONFIG.get("config")
    if config is None or not _is_controller(config) or report.when != "call":
        return
    for key, value in report.user_properties:
        if key == "chapter_run":
            config.stash[_REPORT]["chapters"].setdefault(value["chapter"], {})[f"{value['run']}_s"] = value["seconds"]


_CONFIG: dict = {}


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    _CONFIG["config"] = session.config


def pytest_terminal_summary(terminalreporter, config):
    if not _is_controller(config):
        return
    data = config.stash[_REPORT]
    if not data["chapters"] or config.getoption("nbval_record"):
        return
    from nanovllm_course import release as rel
    import nbformat
    data["calibration_s"].append(_calibrate())
    cal = sum(data["calibration_s"]) / len(data["calibration_s"])
    rows = []
    for name in sorted(data["chapters"]):
        got = data["chapters"][name]
        path = rel.SOLUTIONS / name
        budget = rel.cpu_budget(nbformat.read(path, as_version=4)) if path.is_file() else None
        row = {"chapter": name, "budget_s": budget}
        for run in ("filled", "unfilled"):
            s = got.get(f"{run}_s")
            row[f"{run}_s"] = None if s is None else round(s, 2)
            row[f"{run}_x_calibration"] = None if s is None else round(s / cal, 1)
            row[f"{run}_over_budget"] = None if s is None or budget is None else s > budget
        rows.append(row)
    workers = getattr(config.option, "numprocesses", None) or 0
    meta = {"started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(data["start"])),
            "wall_s": round(time.time() - data["start"], 1), "xdist_workers": workers, "cpus": os.cpu_count(),
            "load_average_start": [round(x, 2) for x in data["load_start"]],
            "load_average_end": [round(x, 2) for x in os.getloadavg()],
            "calibration_s": [round(x, 4) for x in data["calibration_s"]]}
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "chapter_timings.json").write_text(json.dumps({"run": meta, "chapters": rows}, indent=1) + "\n")
    with open(ARTIFACTS / "chapter_timings.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    tr = terminalreporter
    tr.section("chapter timings (a report, not a test: a busy machine is slower, not wrong)")
    tr.line(f"{workers or 1} worker(s) on {os.cpu_count()} CPUs; load average {meta['load_average_start'][0]} at "
            f"the start, {meta['load_average_end'][0]} at the end; calibration {cal:.2f} s")

    def cell(x, fmt="{:.0f}"):
        return "-" if x is None else fmt.format(x)
    tr.line(f"{'chapter':36} {'budget s':>8} {'filled s':>10} {'unfilled s':>10}  over budget")
    for r in rows:
        over = [run for run in ("filled", "unfilled") if r[f"{run}_over_budget"]]
        tr.line(f"{r['chapter']:36} {cell(r['budget_s']):>8} {cell(r['filled_s']):>10} {cell(r['unfilled_s']):>10}"
                f"  {', '.join(over) or '-'}")
    tr.line(f"written to {_rel_path(ARTIFACTS / 'chapter_timings.csv')} and .json")

