"""`ParityReport`: the rows of one parity run, as JSON and as a Markdown table for a PR.

report.ok                    True when no row failed
report.to_json() / to_markdown()
report.write(out_dir)        -> (json_path, md_path), default reports/parity/
ParityReport.from_json(text)
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from .differences import DIFFERENCES
from .families import ALL_FAMILIES, DOCUMENTED, FAIL, NOT_AVAILABLE, PASS, TOLERANCES, FamilyResult

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "reports" / "parity"


@dataclass
class ParityReport:
    header: dict
    rows: list[FamilyResult] = field(default_factory=list)
    # cross mode: per path ("offline" / "streamed"), per frame, the logits against the reference
    # (harness.families.logits_per_frame)
    per_frame: dict = field(default_factory=dict)
    runs: object = field(default=None, repr=False, compare=False)  # engine.Runs of the primary backend
    matrix: dict | None = None  # engine.run_matrix: per pair the first difference, and the odd one out

    # -- summary

    @property
    def ok(self) -> bool:
        return not any(r.status == FAIL for r in self.rows)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = dict.fromkeys((PASS, FAIL, DOCUMENTED, NOT_AVAILABLE), 0)
        for r in self.rows:
            out[r.status] += 1
        return out

    def failed(self) -> list[FamilyResult]:
        return [r for r in self.rows if r.status == FAIL]

    def rows_for(self, family: str, comparison: str | None = None) -> list[FamilyResult]:
        if family not in ALL_FAMILIES:
            raise ValueError(f"unknown family {family!r}; expected one of {ALL_FAMILIES}")
        return [r for r in self.rows if r.family == family and (comparison is None or r.comparison == comparison)]

    def family_status(self, family: str, comparison: str | None = None) -> str:
        """fail if any row fails; else pass if any passes; documented / not available otherwise."""
        rows = self.rows_for(family, comparison)
        statuses = {r.status for r in rows}
        for s in (FAIL, PASS, DOCUMENTED):
            if s in statuses:
                return s
        return NOT_AVAILABLE

    def row(self, family: str, metric: str, comparison: str | None = None) -> FamilyResult:
        found = [r for r in self.rows_for(family, comparison) if r.metric == metric]
        if len(found) != 1:
            raise KeyError(f"{len(found)} rows for {family!r} / {metric!r} / {comparison!r}")
        return found[0]

    # -- JSON

    def as_dict(self) -> dict:
        applied = sorted({r.difference_id for r in self.rows if r.difference_id})
        return {
            "header": self.header,
            "ok": self.ok,
            "counts": self.counts(),
            "rows": [r.as_dict() for r in self.rows],
            "tolerances": {k: {"value": t.value, "justification": t.justification} for k, t in TOLERANCES.items()},
            "documented_differences_applied": [DIFFERENCES[i].as_dict() for i in applied],
            "per_frame_logits": self.per_frame,
            **({"matrix": self.matrix} if self.matrix else {}),
        }

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2, sort_keys=False)

    @classmethod
    def from_json(cls, text: str) -> ParityReport:
        d = json.loads(text)
        return cls(
            header=d["header"],
            rows=[FamilyResult.from_dict(r) for r in d["rows"]],
            per_frame=d.get("per_frame_logits") or {},
            matrix=d.get("matrix"),
        )

    # -- Markdown

    def to_markdown(self) -> str:
        h = self.header
        c = self.counts()
        lines = [f"# Parity report: {h.get('title', '')}", ""]
        lines.append("| | |")
        lines.append("|---|---|")
        for key in (
            "mode",
            "checkpoint",
            "backend",
            "numerics",
            "against",
            "input",
            "seed",
            "system_prompt",
            "chunk_samples",
            "versions",
            "date",
            "elapsed_s",
        ):
            if key in h and h[key] is not None:
                lines.append(f"| {key} | {_cell(_fmt_header(h[key]))} |")
        for key in (k for k in h if k.startswith("load ")):
            lines.append(f"| {key} | {_cell(_fmt_header(h[key]))} |")
        verdict = "PASS" if self.ok else "FAIL"
        lines += [
            "",
            (
                f"**Result: {verdict}** ({len(self.rows)} rows: {c[PASS]} pass, {c[FAIL]} fail, "
                f"{c[DOCUMENTED]} documented difference, {c[NOT_AVAILABLE]} not available)"
            ),
            "",
        ]
        lines += self._matrix_markdown()
        lines.append("| family | comparison | metric | observed | tolerance | margin | first failing frame | status |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for r in self.rows:
            ff = (
                ""
                if r.first_failing_frame is None
                else (f"{r.first_failing_frame}" + ("" if r.frame_unit == "frame" else f" ({r.frame_unit})"))
            )
            margin = "" if r.margin is None else f"{_num(r.margin)} ({r.margin_kind})"
            tol = (
                ""
                if r.tolerance is None
                else (f"{_num(r.tolerance)} ({r.tolerance_name})" if r.tolerance_name else _num(r.tolerance))
            )
            status = {FAIL: "**FAIL**", DOCUMENTED: f"documented: {r.difference_id}"}.get(r.status, r.status)
            lines.append(
                f"| {r.family} | {_cell(r.comparison)} | {_cell(r.metric)} | {_cell(_num(r.observed))} | "
                f"{_cell(tol)} | {_cell(margin)} | {ff} | {status} |"
            )
        notes = [(i, r) for i, r in enumerate(self.rows, 1) if r.note]
        if notes:
            lines += ["", "<details><summary>Row notes</summary>", ""]
            for _i, r in notes:
                lines.append(f"- {r.family} / {r.comparison} / {r.metric}: {_cell(r.note)}")
            lines += ["", "</details>"]
        used = sorted({r.tolerance_name for r in self.rows if r.tolerance_name})
        if used:
            lines += ["", "Tolerances:", "", "| name | value | why |", "|---|---|---|"]
            for name in used:
                t = TOLERANCES[name]
                lines.append(f"| {t.name} | {_num(t.value)} | {_cell(t.justification)} |")
        applied = sorted({r.difference_id for r in self.rows if r.difference_id})
        if applied:
            lines += [
                "",
                "Documented differences applied:",
                "",
                "| id | spec | what | verified by | pinned by |",
                "|---|---|---|---|---|",
            ]
            for i in applied:
                d = DIFFERENCES[i]
                lines.append(
                    f"| {d.id} | {_cell(d.spec)} | {_cell(d.summary)} | {_cell(d.verified_by)} | "
                    f"{_cell(', '.join(d.pinned_by))} |"
                )
        lines += self._per_frame_markdown()
        return "\n".join(lines) + "\n"

    def _matrix_markdown(self) -> list[str]:
        m = self.matrix
        if not m:
            return []

        def ref(x):
            if not x:
                return "—"
            tail = f" ({x['difference_id']})" if x.get("difference_id") else ""
            return f"{x['family']} / {x['comparison'].split(':')[0]} / frame {x['frame']} / {x['field']}{tail}"

        lines = [
            "Matrix: " + ", ".join(m["implementations"]),
            "",
            (
                "| pair | agrees | rows | fail | documented | first failing (family / path / frame / field) | "
                "first documented difference |"
            ),
            "|---|---|---|---|---|---|---|",
        ]
        for tag, p in m["pairs"].items():
            lines.append(
                f"| {tag} | {'yes' if p['ok'] else '**no**'} | {p['rows']} | {p['fail']} | {p['documented']} | "
                f"{_cell(ref(p['first_failure']))} | {_cell(ref(p['first_documented']))} |"
            )
        if m.get("odd_one_out"):
            lines += [
                "",
                "Odd one out (the other implementations agree on the field):",
                "",
                "| path | family | field | odd one out | agreeing | documented |",
                "|---|---|---|---|---|---|",
            ]
            for o in m["odd_one_out"]:
                lines.append(
                    f"| {o['path']} | {o['family']} | {_cell(o['field'])} | **{o['odd_one_out']}** | "
                    f"{', '.join(o['agreeing'])} | {'yes' if o['documented'] else '**no**'} |"
                )
        return lines + [""]

    def _per_frame_markdown(self) -> list[str]:
        lines: list[str] = []
        against = self.header.get("against") or "the reference"
        for path, frames in self.per_frame.items():
            if not frames:
                continue
            worst = {
                ch: max((f[f"{ch}_abs"] for f in frames if not f["after_divergence"]), default=None)
                for ch in ("text", "function")
            }
            lines += [
                "",
                (
                    f"<details><summary>Per-frame logits, {path}: max abs vs {against} "
                    f"(text {_num(worst['text'])}, function {_num(worst['function'])}) with "
                    f"{against}'s top-2 gap</summary>"
                ),
                "",
                (
                    "| frame | text max abs | ref text top-2 gap | text id | function max abs "
                    "| ref function top-2 gap | function id |"
                ),
                "|---|---|---|---|---|---|---|",
            ]
            for f in frames:
                mark = lambda ok: "equal" if ok else "**differs**"  # noqa: E731
                tail = " (after divergence)" if f["after_divergence"] else ""
                lines.append(
                    f"| {f['frame']}{tail} | {_num(f['text_abs'])} | {_num(f['text_gap_ref'])} | "
                    f"{mark(f['text_id_equal'])} | {_num(f['function_abs'])} | "
                    f"{_num(f['function_gap_ref'])} | {mark(f['function_id_equal'])} |"
                )
            lines += ["", "</details>"]
        return lines

    # -- files

    def file_stem(self) -> str:
        h = self.header
        parts = [
            Path(str(h.get("checkpoint") or "model")).name,
            Path(str(h.get("input_name") or "input")).stem,
            str(h.get("backend") or "backend"),
        ]
        if h.get("numerics") not in (None, "reference"):  # a non-default run must not overwrite the default's
            parts.append(str(h["numerics"]))
        if h.get("against"):
            parts += ["vs", Path(str(h["against"])).stem]
        parts.append(f"seed{h.get('seed', 0)}")
        if h.get("system_prompt"):
            parts.append("prompt")
        return re.sub(r"[^A-Za-z0-9._-]+", "-", "_".join(parts)).strip("-")

    def write(self, out_dir=None, stem: str | None = None) -> tuple[Path, Path]:
        out = Path(out_dir) if out_dir is not None else DEFAULT_OUT
        out.mkdir(parents=True, exist_ok=True)
        stem = stem or self.file_stem()
        jp, mp = out / f"{stem}.json", out / f"{stem}.md"
        jp.write_text(self.to_json())
        mp.write_text(self.to_markdown())
        return jp, mp


def _num(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isinf(v):
            return "inf"
        if v == 0:
            return "0"
        return f"{v:.3g}"
    return str(v)


def _fmt_header(v) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k} {val}" for k, val in v.items())
    return str(v)


def _cell(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


__all__ = ["ParityReport", "DEFAULT_OUT"]
