"""`python -m nanovllm_course <command>`: the course machinery's command line.

    release [NAMES...]      write chapters/NN_slug.ipynb from solutions/NN_slug.ipynb (all, or those named)
    check                   exit 1 if committed chapters/ differ from a fresh release (drift check)
    execute NOTEBOOK...     run solution notebooks top to bottom in this environment, save them normalised
    verify [NAMES...]       run released chapters unfilled: every exercise `not done yet`, no other error
    grade [NOTEBOOKS...]    grade student notebooks or folders (a class): one verdict per exercise, a table, a
                            total, --csv/--json (exit 1 unless every required exercise is ok)
    figures [CHAPTERS...]   redraw figures/chNN_*.png (all chapters, or e.g. `figures 01 02`)
    import-py SRC.py DST.ipynb   make a notebook from a percent-format (`# %%`) Python file
    export [CHAPTERS...]    write your exercises from chapters/ into chapters/student/chNN.py (importable,
                            picklable for tensor-parallel workers) and list which engine parts are yours

See nanovllm_course/README.md.
"""
import argparse
import os
import sys
from pathlib import Path

# nbformat's validator imports jsonschema, whose optional IRI format checker (rfc3987_syntax) builds a Lark grammar
# at import: 1.7 s of CPU in every command here (they all read notebooks) for a format that no notebook schema
# uses. This process is the command's own, so it leaves that checker out, before nbformat is imported (the test
# processes do the same: tests/suite_plugin.py). A notebook kernel, the student's, is left as it is.
sys.modules.setdefault("rfc3987_syntax", None)

from nanovllm_course import release as rel  # noqa: E402


def _names(values):
    return [v for v in values] or None


def cmd_execute(args) -> int:
    status = 0
    for p in args.notebooks:
        errors = rel.execute_in_place(Path(p), timeout=args.timeout)
        for e in errors:
            print(f"{p}: cell {e.index} raised {e.ename}: {e.evalue[:300]}", file=sys.stderr)
            status = 1
        if not errors:
            print(f"executed {p}")
    return status


def _chapter_paths(folder, names, command="verify"):
    return rel.pick(rel.solution_paths(folder), names, command, f"chapter notebook in {folder}")


def cmd_verify(args) -> int:
    status = 0
    for path in _chapter_paths(args.chapters, args.names):
        grade = rel.grade_path(path, args.solutions, timeout=args.timeout)
        problems = rel.stub_failures_ok(grade)
        for p in problems:
            print(f"{path.name}: {p}", file=sys.stderr)
        status |= bool(problems)
        if not problems:
            print(f"{path.name}: all {len(grade.verdicts)} exercise(s) 'not done yet', no other cell raised "
                  f"({grade.seconds:.0f} s)")
    return status


def _grade_paths(names) -> list[Path]:
    """The notebooks `grade` is given: files; folders (their NN_slug.ipynb, or, for a folder of student folders,
    each subfolder's); chapter numbers or stems in chapters/."""
    paths = []
    for name in names:
        p = Path(name)
        if p.is_dir():
            found = rel.solution_paths(p)
            if not found:
                found = [nb for sub in sorted(q for q in p.iterdir() if q.is_dir() and not q.name.startswith("."))
                         for nb in rel.solution_paths(sub)]
            if not found:
                raise rel.ReleaseError(f"grade: no chapter notebook (NN_slug.ipynb) in {p} or its subfolders")
            paths += found
        elif p.is_file():
            paths.append(p)
        else:
            paths += _chapter_paths(rel.CHAPTERS, [name], "grade")
    return list(dict.fromkeys(paths))


def cmd_grade(args) -> int:
    from nanovllm_course import grading
    if args.jobs < 1:
        raise rel.ReleaseError(f"grade: --jobs must be >= 1, got {args.jobs}")
    paths = _grade_paths(args.notebooks or [str(rel.CHAPTERS)])
    if not paths:
        print("error: no notebook to grade", file=sys.stderr)
        return 2

    def show(grade):
        shown = os.path.relpath(grade.path) if grade.path else grade.name
        print(f"== {shown if not shown.startswith('..') else grade.path}")
        for line in grade.lines():
            print(line)
        sys.stdout.flush()

    grades = grading.grade_class(paths, Path(args.solutions), timeout=args.timeout, jobs=args.jobs, on_grade=show)
    if len(grades) > 1:
        print()
        print(grading.table(grades))
    if args.csv:
        grading.write_csv(grades, args.csv)
        print(f"wrote {args.csv}")
    if args.json:
        grading.write_json(grades, args.json, solutions=args.solutions)
        print(f"wrote {args.json}")
    return 0 if all(g.ok for g in grades) else 1


def cmd_figures(args) -> int:
    from nanovllm_course import figures
    for path in figures.draw(args.chapters or None, Path(args.out)):
        print(f"wrote {path}")
    return 0


def cmd_import_py(args) -> int:
    from nanovllm_course.release import py_to_notebook
    nb = py_to_notebook(Path(args.src).read_text(encoding="utf-8"))
    Path(args.dst).write_text(rel.dumps(rel.normalize(nb)), encoding="utf-8")
    print(f"wrote {args.dst} (now run: python -m nanovllm_course execute {args.dst})")
    return 0


def cmd_export(args) -> int:
    from nanovllm_course import export as ex
    chapters = [rel.chapter_key(c) for c in args.chapters]
    unknown = [c for c in chapters if c not in ex.EXPORTS]
    if unknown:
        raise rel.ReleaseError(f"export: no chapter with exercises to export named {unknown}; give chapter "
                               f"numbers from {sorted(ex.EXPORTS)}")
    out = Path(args.out) if args.out else ex.default_out(Path(args.notebooks))
    rows = ex.export(Path(args.notebooks), out, chapters or None)
    print(ex.report(rows, args.notebooks, out))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m nanovllm_course", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    def dirs(p):
        p.add_argument("--solutions", default=str(rel.SOLUTIONS))
        p.add_argument("--chapters", default=str(rel.CHAPTERS))

    p = sub.add_parser("release", help="write chapters/ from solutions/")
    dirs(p)
    p.add_argument("names", nargs="*", help="notebook names, stems or 2-digit chapter numbers (default: all)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if chapters/ is stale")
    p.set_defaults(func=rel.main_release)

    p = sub.add_parser("check", help="same as `release --check`")
    dirs(p)
    p.add_argument("names", nargs="*")
    p.set_defaults(func=rel.main_release, check=True)

    p = sub.add_parser("execute", help="execute solution notebooks in place (normalised)")
    p.add_argument("notebooks", nargs="+")
    p.add_argument("--timeout", type=int, default=300, help="seconds per cell")
    p.set_defaults(func=cmd_execute)

    p = sub.add_parser("verify", help="released chapters run unfilled: every exercise 'not done yet'")
    p.add_argument("--chapters", default=str(rel.CHAPTERS))
    p.add_argument("--solutions", default=str(rel.SOLUTIONS))
    p.add_argument("names", nargs="*")
    p.add_argument("--timeout", type=int, default=300)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("grade", help="grade student notebooks: one verdict per exercise, a table, CSV/JSON")
    p.add_argument("notebooks", nargs="*",
                   help="notebook files, folders (one per student, or a folder of student folders), or chapter "
                        "numbers/stems in chapters/ (default: chapters/)")
    p.add_argument("--solutions", default=str(rel.SOLUTIONS),
                   help="where the solution notebooks (the chapters' check cells) are")
    p.add_argument("--timeout", type=int, default=300, help="seconds per cell")
    p.add_argument("--csv", help="write one row per exercise to this CSV file")
    p.add_argument("--json", help="write the whole report (per notebook, per exercise, totals) to this JSON file")
    p.add_argument("--jobs", type=int, default=1, help="notebooks graded at once (each in its own kernel)")
    p.set_defaults(func=cmd_grade)

    p = sub.add_parser("figures", help="redraw figures/chNN_*.png")
    p.add_argument("chapters", nargs="*", help="2-digit chapter numbers (default: all)")
    p.add_argument("--out", default=str(rel.FIGURES))
    p.set_defaults(func=cmd_figures)

    p = sub.add_parser("import-py", help="percent-format .py -> .ipynb (authoring aid)")
    p.add_argument("src")
    p.add_argument("dst")
    p.set_defaults(func=cmd_import_py)

    p = sub.add_parser("export", help="chapters' exercises -> importable student/chNN.py + manifest")
    p.add_argument("chapters", nargs="*", help="2-digit chapter numbers (default: all with parts)")
    p.add_argument("--notebooks", default=str(rel.CHAPTERS), help="folder of filled notebooks (default chapters/)")
    p.add_argument("--out", default=None,
                   help="package folder to write (default: student/ inside the notebooks folder)")
    p.set_defaults(func=cmd_export)

    args = ap.parse_args(argv)
    if getattr(args, "names", None) == []:
        args.names = None
    try:
        return args.func(args)
    except rel.ReleaseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
