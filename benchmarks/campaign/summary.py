"""The campaign's one-page summary (run.py): measured vs goal per row, and the planner against every GPU figure we have.

Reads only long-format CSVs under the results folder (the campaign's ledger gpu_campaign.csv and each row's script
CSV), a row's figures filtered to one git sha and device: a number from another commit or card never enters a row.
The planner section reads every GPU row of any commit, naming its sha and card; it reports the error and changes
no planner constant (one or two points are not a calibration).
"""

from __future__ import annotations

import csv
import functools
import itertools
from pathlib import Path

MIB_PER_GB = 1e9 / 2**20  # the seeds' table is in decimal GB
MIB_PER_GIB = 1024.0


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))


class RowView:
    """One campaign row's figures at one sha and device; what a judge reads."""

    def __init__(self, row, cpu: bool, results: Path, sha: str, device: str, views: dict, versions: str = ""):
        self.row, self.cpu, self.results, self.sha, self.device, self.views = row, cpu, results, sha, device, views
        self.sizes, self.versions = row.sizes(cpu), versions

    def m(self, impl: str | None = None, op: str | None = None, part: str = "") -> dict:
        """{metric: value} of this row's CSV for `impl` (None: any), its op and its shape prefix; `part`: also in
        the shape (rows whose shapes share the prefix, such as the engine rows at two prompt lengths)."""
        prefix, out = self.row.shape_prefix(self.cpu), {}
        for r in read_rows(self.results / self.row.csv):
            if (r["git_sha"], r["device"], r["op"]) != (self.sha, self.device, op or self.row.op):
                continue
            if (impl and r["impl"] != impl) or not r["shape"].startswith(prefix) or part not in r["shape"]:
                continue
            try:
                out[r["metric"]] = float(r["value"])
            except ValueError:
                out[r["metric"]] = r["value"]
        return out

    def killed(self) -> str:
        """'IMPL killed by signal N (host memory available ...)' for each variant whose worker the kernel killed."""
        prefix, found = self.row.shape_prefix(self.cpu), {}
        for r in read_rows(self.results / self.row.csv):
            if (r["git_sha"], r["device"], r["op"]) == (self.sha, self.device, self.row.op) and \
                    r["shape"].startswith(prefix):
                found.setdefault(r["impl"], {})[r["metric"]] = r["value"]
        return "; ".join(f"{impl} killed by signal {float(m['killed_by_signal']):.0f} (host memory available "
                         f"{m.get('host_available_gib', '?')} GiB then, lowest {m.get('host_available_min_gib', '?')} "
                         "GiB while it ran)" for impl, m in found.items() if "killed_by_signal" in m)

    def other(self, name: str) -> RowView | None:
        return self.views.get(name)


def weak_baseline(v: RowView) -> str:
    """trl_tuned is fair only with transformers' own offload (`activation_checkpointing_kwargs`, transformers 5.20+);
    5.17, the GPU hosts' version, lacks it: a ratio against that baseline flatters us, and the verdict says so."""
    from packaging.version import Version

    found = [w.split("=", 1)[1] for w in v.versions.split() if w.startswith("transformers=")]
    if found and Version(Version(found[0]).base_version) < Version("5.20"):
        return f" (baseline weaker than fair: transformers {found[0]} has no activation offload for trl_tuned)"
    return ""


def _ratio(a, b):
    return a / b if a is not None and b else None


def _fmt(x, digits=2):
    return "?" if x is None else f"{x:.{digits}f}"


def _peak(got: dict, cpu: bool):
    """Peak with the weights (MiB): reserved on CUDA; on CPU the RSS peak (reserved does not exist there)."""
    return got.get("peak_step_mem_with_weights_mib" if cpu else "peak_reserved_with_weights_mib")


# Each judge: (what was measured, verdict); ("", "") when nothing of the row is in its CSV at this sha.
NO_GOAL = "cpu check: no goal"


def judge_preset(v: RowView):
    """Row preset_<impl>: the CSV's impl is the preset's name (+engine: its own route, the colocated engine)."""
    got = v.m(v.row.name.removeprefix("preset_"))
    if not got:
        return "", ""
    if not got.get("completed"):
        return "did not complete 2 steps", "missed"
    pred, res, alloc = got.get("predicted_reserved_gib"), got.get("peak_reserved_gib"), got.get("peak_allocated_gib")
    if v.cpu:  # no reserved memory on CPU; the "allocated" telemetry is the host RSS
        return f"2 steps; host RSS peak {_fmt(alloc)} GiB, planner {_fmt(pred)} GiB", NO_GOAL
    split = (f" (generation {_fmt(got['generation_time_s'], 1)} s)" if got.get("generation_time_s") is not None
             else "")
    text = (f"2 steps, median step {_fmt(got.get('step_time_s'), 1)} s{split}; reserved {_fmt(res)} GiB, allocated "
            f"{_fmt(alloc)} GiB, planner {_fmt(pred)} GiB")
    err = _ratio(pred, res)
    return text + f" (planner / reserved {_fmt(err, 3)})", "met" if err and abs(err - 1) <= 0.10 else "missed"


def judge_engine_prefill(v: RowView):
    """Row engine_prefill_<preset> (issue 43 e): one full-length sequence through the preset's engine; the plan's
    generation phase (MemoryPlan.generation_bytes, the engine's whole budget) within 10% of torch's peak reserved."""
    preset = v.row.name.removeprefix("engine_prefill_")
    got = v.m("cpu" if v.cpu else preset)
    if not got:
        return "", ""
    if "prefill_s" not in got:
        return "did not finish: " + ", ".join(k for k in ("oom", "timed_out", "killed_by_signal") if got.get(k)), \
            "missed"
    text = (f"{_fmt(got.get('prefill_tokens'), 0)} tokens prefilled in {_fmt(got['prefill_s'], 1)} s; KV cache "
            f"{_fmt(got.get('kv_cache_gib'), 1)} GiB (plan {_fmt(got.get('plan_kv_cache_gib'), 1)})")
    if v.cpu:  # the host RSS holds vLLM's and torch's libraries, which the plan does not count
        return text + f"; host RSS peak {_fmt(got.get('peak_allocated_gib'))} GiB", NO_GOAL
    err = got.get("plan_over_reserved")
    text += (f"; reserved {_fmt(got.get('peak_reserved_gib'))} GiB, used {_fmt(got.get('used_gib'))} GiB, plan's "
             f"generation phase {_fmt(got.get('plan_generation_reserved_gib'))} GiB (plan / reserved {_fmt(err, 3)})")
    return text, "met" if err and abs(err - 1) <= 0.10 else "missed"


def judge_step_32k(v: RowView):
    trl, ours = v.m("trl_tuned"), v.m("ours_mb1")
    if not trl or not ours:
        return "", ""
    if ours.get("oom") or trl.get("oom"):
        return f"out of memory: ours_mb1 {ours.get('oom'):g}, trl_tuned {trl.get('oom'):g}", "missed" if ours.get(
            "oom") else "met (TRL out of memory)"
    mem, time = _ratio(_peak(ours, v.cpu), _peak(trl, v.cpu)), _ratio(ours["step_time_ms"], trl["step_time_ms"])
    text = (f"peak with weights ours_mb1 {_fmt(_peak(ours, v.cpu), 0)} MiB / trl_tuned {_fmt(_peak(trl, v.cpu), 0)} "
            f"MiB = {_fmt(mem)}x; step time {_fmt(time)}x")
    if v.cpu:
        return text, NO_GOAL
    return text, ("met" if mem <= 0.5 and time <= 1.1 else "missed") + weak_baseline(v)


def judge_seeds_20k(v: RowView):
    trl, ours = v.m("trl_tuned"), v.m("ours_mb1")
    if not ours:
        return "", ""
    if ours.get("oom"):
        return "ours_mb1 out of memory", "missed"
    gb = {k: _peak(x, v.cpu) / MIB_PER_GB if x and not x.get("oom") else None for k, x in
          (("ours", ours), ("trl", trl))}
    text = (f"peak with weights: ours_mb1 {_fmt(gb['ours'], 1)} GB, trl_tuned {_fmt(gb['trl'], 1)} GB (the seeds' "
            f"estimates: Unsloth 54.3 GB, TRL+FA2 510.8 GB)")
    if v.cpu:
        return text, NO_GOAL
    return text, "met" if gb["ours"] <= 27.0 else "missed"


def _judge_one_step(v: RowView, reserved: bool, min_T: int, met: str):
    """Does one ours_mb1 step at the row's T fit (and is T >= min_T): the max_t and gpt-oss rows."""
    got, T = v.m("ours_mb1"), v.sizes["completion_length"]
    if not got:
        return "", ""
    fits = got.get("oom") == 0
    peak = got.get("peak_reserved_with_weights_mib", _peak(got, v.cpu)) if reserved else _peak(got, v.cpu)
    what = "peak reserved with weights" if reserved else "peak with weights"
    text = f"ours_mb1 step at T={T}: " + (f"fits, {what} {_fmt(peak, 0)} MiB" if fits else "out of memory")
    if v.cpu:
        return text, NO_GOAL
    return text, met if fits and T >= min_T else "missed"


def judge_max_t_ours(v: RowView):
    return _judge_one_step(v, reserved=False, min_T=256 * 1024, met="met (>= 256K)")


def judge_step_fits(v: RowView):
    """A step at the row's T fits (issue 36's gpt-oss rows); the planner's error is the planner table's row."""
    return _judge_one_step(v, reserved=True, min_T=0, met="met (fits)")


def judge_max_t_trl(v: RowView):
    got = v.m("trl_tuned", op="grpo_max_completion_length")
    if "max_completion_length" not in got:
        return "", ""
    longest = int(got["max_completion_length"])
    text = f"trl_tuned longest T {longest} ({int(got.get('probes', 0))} probes)"
    ours = v.other("max_t_ours")
    fits = ours is not None and ours.m("ours_mb1").get("oom") == 0
    ours_T = ours.sizes["completion_length"] if fits else None
    if ours_T:
        text += f"; ours fits {ours_T}: {_fmt(_ratio(ours_T, longest))}x"
    if v.cpu:
        return text, NO_GOAL
    if ours_T is None:
        return text, "open (ours at 256K not measured or out of memory)"
    return text, ("met (>= 2x)" if longest and ours_T >= 2 * longest else "missed") + weak_baseline(v)


# Unsloth's step rows (issue 44) and the row of ours + tuned TRL at the same shape, sizes and sha
UNSLOTH_PAIRS = {"unsloth_20k": "seeds_20k", "unsloth_32k": "step_32k"}


def judge_unsloth(v: RowView):
    """Issue 44's goals against Unsloth at the same shape: peak reserved with weights <= 0.8x Unsloth's, time per
    token <= 1.1x; ours and tuned TRL come from the paired row (same CSV shape, same call)."""
    u = v.m("unsloth")
    if not u:
        return "", ""
    if u.get("oom") or u.get("timed_out") or "killed_by_signal" in u:
        return "unsloth: " + ("out of memory" if u.get("oom") else "did not finish"), NO_GOAL if v.cpu else "open"
    pair = v.other(UNSLOTH_PAIRS.get(v.row.name, ""))
    ours, trl = (pair.m("ours_mb1"), pair.m("trl_tuned")) if pair else ({}, {})
    peak = "peak_reserved_with_weights_mib"
    mem, t = _ratio(ours.get(peak), u.get(peak)), _ratio(ours.get("step_time_ms"), u.get("step_time_ms"))
    text = (f"unsloth reserved {_fmt(u.get(peak, 0) / MIB_PER_GIB, 1)} GiB, {_fmt(u.get('step_time_ms'), 0)} ms; "
            f"ours/unsloth: reserved {_fmt(mem)}x, time {_fmt(t)}x; ours/trl_tuned reserved "
            f"{_fmt(_ratio(ours.get(peak), trl.get(peak)))}x")
    if v.cpu or not ours:
        return text, NO_GOAL if v.cpu else "open (ours not measured at this sha yet)"
    return text, "met" if mem is not None and mem <= 0.8 and (t is None or t <= 1.1) else "missed"


def judge_unsloth_max_t(v: RowView):
    """Unsloth's longest completion that fits vs ours: the goal is ours >= 1.5x (ours probed by max_t_ours at 256K
    and long_t_64k, read from their rows)."""
    u = v.m("unsloth", op="grpo_max_completion_length")
    if "max_completion_length" not in u:
        return "", ""
    longest = int(u["max_completion_length"])
    fits = [r.sizes["completion_length"] for r in (v.other("max_t_ours"), v.other("long_t_64k")) if r and
            r.m("ours_mb1") and not r.m("ours_mb1").get("oom") and r.m("ours_mb1").get("peak_step_mem_mib")]
    ours = max(fits, default=0)
    text = f"unsloth's longest {longest} tokens (first failed {int(u.get('first_failed_t', 0))}); ours fits {ours}"
    if v.cpu or not ours or not longest:
        return text, NO_GOAL if v.cpu else "open"
    return text + f" ({ours / longest:.2f}x)", "met" if ours >= 1.5 * longest else "open (probe ours longer)"


def judge_engine(v: RowView):
    """Issue 43's engine rows. Sharing: the training model's bytes inside the engine's storages (1.0), the engine's
    cost on top of the training model below the copy's by about the weights, no larger log-prob gap than the copy's
    (same engine, same weights), decode within 10% of the copy's. The 4-bit row has no goal: its figures."""
    # only this row's own variants at its own prompt length: the three rows share engine.csv and a shape prefix
    # (before, a pending engine_4bit showed engine_shared's figures and its verdict)
    args = v.row.cpu_args if v.cpu and isinstance(v.row.cpu_args, tuple) else v.row.args
    own = args[args.index("--variants") + 1:] if "--variants" in args else ()
    part = f",P={v.sizes['prompt_length']},"
    sh, cp, q = ({} if i not in own else v.m(i, part=part) for i in ("shared", "copy", "4bit"))
    if not (sh or q):
        return "", ""
    gib = lambda x: _fmt(x.get("engine_cost_gib"), 1)  # noqa: E731
    if q:
        return (f"4bit: weights shared {_fmt(q.get('weights_shared'))}, engine cost {gib(q)} GiB (KV "
                f"{_fmt(q.get('kv_cache_gib'), 1)}), gap max {_fmt(q.get('logprob_gap_max'), 3)} / mean "
                f"{_fmt(q.get('logprob_gap_mean'), 4)} nats"), NO_GOAL if v.cpu else "measured (no goal)"
    decode = sorted(k for k in sh if k.startswith("decode_tok_s_"))
    speed = {k.rsplit("_", 1)[-1]: _ratio(sh.get(k), cp.get(k)) for k in decode}
    # a refused share fails the shared variant (bench_engine.py): the row is then failed, with its log's tail
    agree = (f"engine vs HF {_fmt(sh.get('self_check_error'), 3)} nats (bound {_fmt(sh.get('agreement_bound'), 3)}); "
             if sh.get("agreement_bound") is not None else "")
    text = agree + (
            f"shared: weights shared {_fmt(sh.get('weights_shared'))}, engine cost {gib(sh)} GiB vs the copy's "
            f"{gib(cp)} (KV {_fmt(sh.get('kv_cache_gib'), 1)}); gap max {_fmt(sh.get('logprob_gap_max'), 3)} vs "
            f"{_fmt(cp.get('logprob_gap_max'), 3)}; decode shared/copy "
            + ", ".join(f"{_fmt(r)}x at C={c}" for c, r in speed.items()))
    if v.cpu:
        return text, NO_GOAL
    met = (sh.get("weights_shared", 0) >= 0.99 and sh.get("self_check_error", 1e9) <= sh.get("agreement_bound", 0)
           and cp and sh.get("engine_cost_gib", 1e9) < cp.get("engine_cost_gib", 0)
           and sh.get("logprob_gap_max", 1e9) <= 1.5 * cp.get("logprob_gap_max", 0) + 1e-3
           and speed and all(r is not None and r >= 0.9 for r in speed.values()))
    return text, "met" if met else "missed"


def judge_cb_generation(v: RowView):
    """Issue 45 (5): route continuous_batching vs generate() per completion length (bench_continuous_batching.py):
    tokens/s of both, each one's generation peak, and paged's peak against its plan (pool + working set): met when
    that is within 10% at every length the row runs (the GPU's allocated peak; CPU: RSS, no goal)."""
    p, g = v.m("paged"), v.m("generate")
    if not (p or g):
        return "", ""
    Cs = sorted({int(k.rsplit("_", 1)[1]) for x in (p, g) for k in x if k.rsplit("_", 1)[-1].isdigit()})

    def one(x: dict, C: int, name: str) -> str:
        for flag, words in (("oom", "out of memory"), ("timed_out", "timed out"), ("killed_by_signal", "killed")):
            if x.get(f"{flag}_{C}"):
                return f"{name} {words}"
        if f"decode_tok_s_{C}" not in x:
            return f"{name} not measured"
        return f"{name} {_fmt(x[f'decode_tok_s_{C}'], 1)} tok/s, peak {_fmt(x.get(f'peak_gib_{C}'))} GiB"

    parts, errs = [], {}
    for C in Cs:
        err = _ratio(p.get(f"plan_gib_{C}"), p.get(f"peak_gib_{C}"))
        errs[C] = err
        speed = _ratio(p.get(f"decode_tok_s_{C}"), g.get(f"decode_tok_s_{C}"))
        parts.append(f"C={C}: {one(p, C, 'paged')} (plan {_fmt(p.get(f'plan_gib_{C}'))}, plan / peak {_fmt(err, 3)}); "
                     f"{one(g, C, 'generate')}; paged / generate tokens/s {_fmt(speed)}x")
    text = "; ".join(parts)
    if v.cpu:
        return text, NO_GOAL
    flags = list(v.row.flags_of(False))
    want = [int(c) for c in itertools.takewhile(str.isdigit, flags[flags.index("--completion-lengths") + 1:])]
    if any(C not in errs or errs[C] is None for C in want):
        return text, "open (a length not measured yet)"
    return text, "met" if all(abs(errs[C] - 1) <= 0.10 for C in want) else "missed"


def judge_packing(v: RowView):
    pad, pk = v.m("padded"), v.m("packed")
    if not pad or not pk:
        return "", ""
    time_metric = "step_cpu_ms" if v.cpu else "step_time_ms"  # CPU: process time, steadier on a shared host
    speed = _ratio(pad.get(time_metric), pk.get(time_metric))
    mem = _ratio(pk.get("peak_step_mem_mib"), pad.get("peak_step_mem_mib"))
    text = f"packed {_fmt(speed)}x faster ({time_metric}), {_fmt(mem)}x the padded peak above the model"
    if v.cpu:
        return text, NO_GOAL
    return text, "met" if speed and mem and speed >= 1.5 and mem <= 0.7 else "missed"


def judge_shared_prompt(v: RowView):
    """Issue 28's goal: the shared policy step >= 3x faster than the packed one and its peak <= 1/3 of packed's."""
    sh, pk, tp = v.m("shared"), v.m("packed"), v.m("trl_padded")
    if not sh:
        return "", ""
    if sh.get("oom") or sh.get("timeout"):
        return "shared: " + ("out of memory" if sh.get("oom") else "timed out"), NO_GOAL if v.cpu else "missed"
    time_metric = "step_cpu_ms" if v.cpu else "step_time_ms"
    parts = [f"vs {name}: {_fmt(_ratio(x.get(time_metric), sh.get(time_metric)))}x faster, "
             f"{_fmt(_ratio(sh.get('peak_step_mem_mib'), x.get('peak_step_mem_mib')))}x peak" if x and not
             (x.get("oom") or x.get("timeout")) else f"{name} out of memory or timed out"
             for name, x in (("packed", pk), ("trl_padded", tp)) if x]
    text = "shared " + "; ".join(parts)
    if v.cpu:
        return text, NO_GOAL
    if not pk or pk.get("oom") or pk.get("timeout"):
        return text, "met" if pk else ""  # packed out of memory where shared ran: more than the goal
    speed = _ratio(pk.get(time_metric), sh.get(time_metric))
    mem = _ratio(sh.get("peak_step_mem_mib"), pk.get("peak_step_mem_mib"))
    return text, "met" if speed and mem and speed >= 3 and mem <= 1 / 3 else "missed"


# ------------------------------------------------------------------------------------------ the state of each row
def ledger_state(ledger: list[dict], name: str, sha: str, device: str) -> dict | None:
    """The campaign's record of a row at this sha and device (exit_code, timed_out, wall_s, limit_s), or None."""
    got = {r["metric"]: float(r["value"]) for r in ledger
           if r["impl"] == name and r["git_sha"] == sha and r["device"] == device}
    return got or None


def is_done(state: dict | None) -> bool:
    """Done = exited 0 within its limit. Failed or timed out is not done: the next call runs it again."""
    return state is not None and not state.get("timed_out") and state.get("exit_code") == 0


def exit_words(code) -> str:
    """A row's end in words: None = killed at its limit by the campaign, < 0 = killed by a signal."""
    if code is None:
        return "timed out"
    return f"killed by signal {-code:.0f}" if code < 0 else f"exit {code:.0f}"


def describe_state(state: dict | None, present: bool) -> str:
    if state is None:
        return "pending" if present else "script not present yet"
    tries = f", try {state['attempts']:.0f}" if state.get("attempts", 1) > 1 else ""
    if state.get("timed_out"):
        return f"timed out at its limit, {state['limit_s']:.0f} s{tries}"
    if state.get("exit_code"):
        host = state.get("host_available_gib", -1)
        free = f", host memory available then {host:.1f} GiB" if host >= 0 else ""
        return f"failed ({exit_words(state['exit_code'])}{free}{tries}; log tail below)"
    return f"done in {state['wall_s']:.0f} s{tries}"


# ------------------------------------------------------------------------------------------------- the planner
# The first GPU point, measured before presets_gpu.csv travelled back with the campaign's results (issue 35): the
# h100_110k preset on an H200 host, 2 steps with 42-token prompts (SmolLM2's tokenizer) and 128-token completions,
# generate() (vLLM absent there). Its plan (15.1 GiB) counted a colocated engine that never started (issue 34).
FIRST_POINT = dict(preset="h100_110k", device="NVIDIA H200", sha="unrecorded (issue 29's campaign code)",
                   date="2026-11-26", prompt=42, completion=128, planned_then_gib=15.1, reserved_gib=6.44,
                   step_time_s=19.4)


@functools.lru_cache(maxsize=64)  # the summary is rewritten after every row; the plan of a point does not change
def plan_now_gib(preset: str, prompt: int, completion: int) -> float | None:
    """This checkout's planner at a measured point (gpu_presets.predicted_reserved_gib: the preset's flags, the point's
    lengths): a planner fix shows here on the next summary, with no figure re-measured."""
    from gpu_presets import predicted_reserved_gib

    try:
        return predicted_reserved_gib(preset, ["--max_completion_length", str(completion)], prompt)
    except Exception as exc:  # a preset renamed or removed since the point was measured
        print(f"[summary] planner for {preset} at {prompt}+{completion}: {type(exc).__name__}: {exc}")
        return None


def _preset_point(preset, where, date, prompt, completion, then, reserved) -> dict:
    now = plan_now_gib(preset, prompt, completion)
    return dict(preset=preset, where=where, date=date, tokens=f"{prompt} + {completion}",
                then=_fmt(then), now=_fmt(now), reserved=_fmt(reserved),
                error_then=f"{then / reserved - 1:+.1%}" if then else "?",
                error_now=f"{now / reserved - 1:+.1%}" if now else "?")


def planner_vs_presets(results: Path) -> list[dict]:
    """Every GPU point of a single-GPU preset, first the one measured before the campaign: the plan printed by the
    run, this checkout's plan at the same lengths, measured peak reserved."""
    from grpo_accel.app.presets import PRESETS

    p = FIRST_POINT
    out = [_preset_point(p["preset"], f"{p['device']} @ {p['sha']}", p["date"], p["prompt"], p["completion"],
                         p["planned_then_gib"], p["reserved_gib"])]
    measured = {}
    for r in read_rows(results / "presets_gpu.csv"):
        if r["op"] == "preset_2_steps" and not r["device"].startswith("cpu"):
            key = (r["impl"], r["device"], r["git_sha"], r["shape"], r["date"])
            measured.setdefault(key, {})[r["metric"]] = float(r["value"])
    for (name, dev, sha, shape, date), m in sorted(measured.items()):
        if name not in PRESETS or not m.get("peak_reserved_gib"):
            continue
        prompt = int(shape.split("T=")[1].split("+")[0])
        out.append(_preset_point(name, f"{dev} @ {sha}", date, prompt, int(m["completion_length_run"]),
                                 m.get("predicted_reserved_gib"), m["peak_reserved_gib"]))
    return out


def planner_vs_steps(results: Path) -> list[dict]:
    """Every CUDA row of step_memory.csv against the planner's model of the same variant (bench_step_memory.plan_for):
    predicted peak vs measured allocated and reserved, both with the weights."""
    from bench_step_memory import VARIANTS, plan_for

    groups = {}
    for r in read_rows(results / "step_memory.csv"):
        if r["op"] == "grpo_step_fwd_bwd" and not r["device"].startswith("cpu") and r["impl"] in VARIANTS:
            groups.setdefault((r["impl"], r["shape"], r["device"], r["git_sha"]), {})[r["metric"]] = float(r["value"])
    out = []
    for (impl, shape, dev, sha), m in sorted(groups.items()):
        if m.get("oom") or "peak_step_mem_mib" not in m:
            continue
        fields = dict(f.split("=", 1) for f in shape.split(",") if "=" in f)
        arch, adapter = shape.split(",")[:2]
        plan = plan_for(arch, "4bit" if adapter.startswith("qlora") else "none", int(fields["G"]), int(fields["P"]),
                        impl, T=int(fields["T"]))
        alloc = m.get("peak_step_mem_with_weights_mib", m["peak_step_mem_mib"] + m.get("model_mem_mib", 0))
        reserved = m.get("peak_reserved_with_weights_mib")
        if reserved is None and "peak_reserved_mib" in m:  # rows before _with_weights: reserved above the model
            reserved = m["peak_reserved_mib"] + m.get("model_mem_mib", 0)
        pred = plan.peak_gib
        out.append(dict(impl=impl, shape=shape, where=f"{dev} @ {sha}", predicted=f"{pred:.2f}",
                        allocated=f"{alloc / MIB_PER_GIB:.2f}", reserved=_fmt(reserved and reserved / MIB_PER_GIB),
                        vs_allocated=f"{pred / (alloc / MIB_PER_GIB) - 1:+.1%}",
                        vs_reserved=f"{pred / (reserved / MIB_PER_GIB) - 1:+.1%}" if reserved else "?"))
    return out


def _table(headers: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    return lines + ["| " + " | ".join(str(c).replace("|", "/") for c in r) + " |" for r in rows]


def write_summary(path: Path, meta: dict, entries: list[dict], unselected: list[tuple[str, str]],
                  results: Path) -> None:
    """The one page: what ran where, each row's state and measured vs goal, then the planner's error."""
    lines = [f"# GPU campaign{' (CPU check: plumbing only, tiny sizes, no goal applies)' if meta['cpu'] else ''}", "",
             f"device: {meta['device']}; versions: {meta['versions']}; git sha: {meta['sha']}; date: {meta['date']}",
             "", "Written by `benchmarks/campaign/run.py` after every row; figures from this sha and device only.", ""]
    lines += _table(["#", "row", "measures", "goal", "state", "measured", "verdict"],
                    [[i + 1, e["name"], e["measures"], e["goal"], e["state"], e["measured"] or "-",
                      e["verdict"] or "pending"] for i, e in enumerate(entries)])
    failed = [e for e in entries if e.get("tail")]
    if failed:
        lines += ["", "## Failures (the next call runs these again; --skip-failed leaves them)"]
        for e in failed:
            lines += ["", f"{e['name']}: {e['state']}. The last lines of its log:", "", "```", e["tail"].rstrip(),
                      "```"]
    if unselected:
        lines += ["", "Not run on this device: " + "; ".join(f"{n} ({why})" for n, why in unselected) + "."]
    notes = [f"- {e['name']}: {e['note']}" for e in entries if e.get("note")]
    lines += ["", "Notes:", *notes] if notes else []
    lines += ["", "## The planner against measured GPU memory", "",
              "Error = predicted / measured - 1 (negative: the planner under-predicts). Reported, not fitted: no "
              "planner constant changes until several GPU points agree.", "", "Per GPU point of a single-GPU preset "
              "(2 steps through `accelerate launch`; `presets_gpu.csv` and the first point, measured before it; goal: "
              "within 10% of reserved). \"plan then\": what the run printed; \"plan now\": this checkout's planner "
              "at the same lengths.", ""]
    lines += _table(["preset", "measured on", "date", "prompt + completion tokens", "plan then GiB",
                     "plan now GiB", "reserved GiB", "error then", "error now"],
                    [[r["preset"], r["where"], r["date"], r["tokens"], r["then"], r["now"], r["reserved"],
                      r["error_then"], r["error_now"]] for r in planner_vs_presets(results)])
    steps = planner_vs_steps(results)
    lines += ["", "One GRPO step (`step_memory.csv`, CUDA rows; peaks with the weights):", ""]
    lines += _table(["variant", "shape", "measured on", "planner GiB", "allocated GiB", "reserved GiB",
                     "vs allocated", "vs reserved"],
                    [[r["impl"], r["shape"], r["where"], r["predicted"], r["allocated"], r["reserved"],
                      r["vs_allocated"], r["vs_reserved"]] for r in steps]) if steps else ["none measured yet"]
    path.write_text("\n".join(lines) + "\n")
