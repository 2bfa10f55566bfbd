"""The mutation check: one-line bugs put into the package, one at a time, each with the tests that must fail on it. A
bug every test passes is a hole in the tests (issue 63: 4 of 21 passed, ../shared/mutations.md at 7f86a37).

    make test-mutations                                   # or: .venv/bin/python tests/mutations.py
    .venv/bin/python tests/mutations.py --only 8b 10c     # some of them;  --list: what there is

Each mutation: a file, an exact pattern (found exactly once), its replacement, the pytest selection that must fail
and the venv it runs in (`main`: .venv, the CPU and distributed tiers' tests; `vllm`: .venv-vllm, tests/vllm_engine).
The check copies the checkout (git's tracked and untracked files, not the venvs) into a scratch folder, runs each
selection once unmutated (it must pass: a failure there would count as a kill), then each mutation in turn: applied,
its selection run (`-x`: the first failure kills it), the file restored (also on Ctrl-C or SIGTERM; the scratch copy
is deleted at the end). The working tree is never edited, so it runs beside other work in the same checkout.
Exit 1 naming every mutation that survived (its selection passed or skipped), whose pattern no longer matches, or
whose selection errored (collection error, timeout: not a kill); mutations for a venv that is not built are skipped
and listed, not failed.

A new capability lands with its one-line bugs here: the plausible slip in each rule it adds (a bound off by one, a
list kept or dropped, a rank's share, an order of writes) and the test that catches it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENVS = {"main": ".venv", "vllm": ".venv-vllm"}


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str  # the bug, in words
    path: str  # relative to the checkout
    pattern: str  # exact text, found exactly once in `path`
    replacement: str
    tests: tuple[str, ...]  # pytest node ids: at least one must fail
    venv: str = "main"  # a key of VENVS


R, RB, AS, SG = ("grpo_accel/generation/rollouts.py", "grpo_accel/generation/rollout_budget.py",
                 "grpo_accel/generation/adapter_sync.py", "grpo_accel/generation/server_generation.py")
CR, TH, VG = ("grpo_accel/trainer/carried_rollouts.py", "grpo_accel/app/train_help.py",
              "grpo_accel/generation/vllm_generation.py")
TAKE = ("tests/test_rollouts.py::"
        "test_complete_groups_within_the_bound_go_out_oldest_first_and_older_ones_are_dropped_and_counted")
STEP = "tests/test_rollout_budget.py::test_a_step_ends_when_enough_groups_are_complete_and_carries_the_rest"
CARRIED = "tests/test_carried_rollouts.py::test_carried_groups_train_as_trls_trainer_fed_the_same_rows_and_rollouts"
GREEDY = "tests/test_carried_rollouts.py::test_carried_completions_are_the_greedy_decode_and_train_off_policy"
SIGKILL = "tests/test_budget_sigkill.py::test_sigkill_mid_step_then_resume_continues_the_carried_rollouts"
SERVER = "tests/test_server_generation.py::"
SERVER_2 = "tests/test_server_distributed.py::test_two_ranks_train_through_one_server[2]"
TS, OT, TSM = ("tests/test_truncated_sampling.py::", "grpo_accel/ops/truncation.py",
               "grpo_accel/trainer/truncated_sampling.py")
TS_TRAINER = TS + "test_top_p_on_policy_ratio_is_one_through_a_budgeted_run[padded]"
DS, DS_T = "grpo_accel/trainer/dynamic_sampling.py", "tests/test_dynamic_sampling.py::"
RR, LP = "grpo_accel/head/routing_replay.py", "grpo_accel/trainer/logprob_passes.py"
RC, CR = "grpo_accel/generation/routing_capture.py", "grpo_accel/trainer/carried_rollouts.py"
CAPTURE = "tests/test_routing_capture.py::"
REPLAY = "tests/test_routing_replay.py::"
RULE = "return staleness <= max_staleness"  # rollouts.within_staleness: the one staleness rule
KEEP = "keep = [g for g in self.groups if within_staleness(g.staleness(version), self.max_staleness)]"
AHEAD = "if req.prompts == prompts and within_staleness(step - req.version, self.max_staleness):"

# ../shared/mutations.md's rows (their numbers; 1, 1b and 5c follow the staleness rule into its one home), then each
# capability's own since.
MUTATIONS = [
    Mutation("1", "staleness rule `<=` -> `<`: groups exactly at the bound vanish", R, RULE,
             RULE.replace("<=", "<"), (TAKE,)),
    Mutation("1-server", "the same, caught where the server's batches ahead use the rule", R, RULE,
             RULE.replace("<=", "<"), (SERVER + "test_steps_ahead_equal_trls_trainer_fed_the_same_rollouts",)),
    Mutation("1b", "the buffer keeps every group, however old (the rule not applied)", R, KEEP,
             "keep = list(self.groups)", (TAKE,)),
    Mutation("2", "RolloutBuffer.take newest first", R, "key=lambda g: (g.oldest_version, g.group_id))",
             "key=lambda g: (g.oldest_version, g.group_id), reverse=True)", (TAKE,)),
    Mutation("3", "Rollout.extend records version - 1", R, "self.versions += [int(version)] * len(ids)",
             "self.versions += [int(version) - 1] * len(ids)", (TAKE,)),
    Mutation("3b", "Rollout.extend records the completion's first version for continued tokens", R,
             "self.versions += [int(version)] * len(ids)",
             "self.versions += [self.versions[0] if self.versions else int(version)] * len(ids)",
             ("tests/test_rollouts.py::test_a_record_refuses_what_cannot_be_corrected",)),
    Mutation("4a", "adapter cast undone: fp32 files over a bf16 base", AS, "{**state, **cast}", "{**cast, **state}",
             ("tests/test_adapter_sync.py::test_a_bf16_base_gets_bf16_files_and_the_trainers_adapter_stays_fp32",)),
    Mutation("4a-vllm", "adapter cast undone, loaded into vLLM", AS, "{**state, **cast}", "{**cast, **state}",
             ("tests/vllm_engine/test_vllm_lora_dtype.py::test_bf16_files_load_in_vllm_bit_equal_to_fp32_files",),
             venv="vllm"),
    Mutation("4b", "API key header never sent", AS, 'req.add_header("Authorization", f"Bearer {api_key}")', "pass",
             ("tests/test_adapter_sync.py::test_each_version_loads_under_its_own_name_and_old_ones_go",)),
    Mutation("5a", "behaviour log-probs handed to TRL replaced by 0.0", SG,
             "[[[x] for x in seq] for seq in logps[mine]]", "[[[0.0] for x in seq] for seq in logps[mine]]",
             (SERVER + "test_steps_ahead_equal_trls_trainer_fed_the_same_rollouts",)),
    Mutation("5b", "server batch sampled ahead used however old", SG, AHEAD, "if req.prompts == prompts:",
             (SERVER + "test_a_batch_not_asked_for_or_too_old_is_dropped_and_sampled_again",)),
    Mutation("5c", "server batch's age counted one too many", SG, AHEAD,
             AHEAD.replace("step - req.version", "step - req.version + 1"),
             (SERVER + "test_steps_ahead_equal_trls_trainer_fed_the_same_rollouts",)),
    Mutation("6a", "carried completions decoded from the prompt again", RB,
             "sequences = [g.prompt_ids + r.completion_ids for g, r in running]",
             "sequences = [g.prompt_ids for g, r in running]", (STEP,)),
    Mutation("6a-trainer", "6a, caught by the trainer-level tests (the unit file left out)", RB,
             "sequences = [g.prompt_ids + r.completion_ids for g, r in running]",
             "sequences = [g.prompt_ids for g, r in running]", (GREEDY,)),
    Mutation("6b", "a group complete when any completion ended", R, "return all(r.finished for r in self.rollouts)",
             "return any(r.finished for r in self.rollouts)", (STEP,)),
    Mutation("7", "checkpoint saves an empty buffer", R, "groups = [dataclasses.asdict(g) for g in self.groups]",
             "groups = []", (SIGKILL,)),
    Mutation("7b", "resume drops the saved buffer", RB, 'self.buffer = RolloutBuffer.from_state_dict(state["buffer"])',
             "self.buffer = RolloutBuffer(self.buffer.num_generations, self.buffer.max_staleness)", (SIGKILL,)),
    Mutation("8", "shipped --help returned whatever its versions line", TH,
             "return text if first == versions_line() else None", "return text",
             ("tests/test_cli_startup.py::test_help_for_other_versions_is_the_live_parsers",)),
    Mutation("8b", "versions line no longer names transformers", TH, 'VERSIONED = ("trl", "transformers")',
             'VERSIONED = ("trl",)', ("tests/test_cli_startup.py::test_shipped_help_is_the_live_parsers",)),
    Mutation("9a", "every carried token handed to TRL as on-policy (NaN)", CR, "lp if engine or v < version else",
             "lp if engine or v > version else", (CARRIED,)),
    Mutation("9a-trainer", "9a, caught by a step's importance ratio (the NaN-mask check left out)", CR,
             "lp if engine or v < version else", "lp if engine or v > version else", (GREEDY,)),
    Mutation("9b", "TRL's correction gate off under a budget", CR, "trainer.use_vllm = True  #",
             "trainer.use_vllm = False  #", (CARRIED,)),
    Mutation("10a", "colocated vLLM rounds drop the tokens decoded past a round's limit", VG,
             "r.ids[:limit], r.logps[:limit], r.ids[limit:], r.logps[limit:]", "r.ids[:limit], r.logps[:limit], [], []",
             ("tests/vllm_engine/test_vllm_rollout_budget.py::test_budgeted_rounds_equal_one_unbudgeted_greedy_decode",),
             venv="vllm"),
    Mutation("10d", "colocated vLLM rounds: a completion whose stop token is among the tokens kept for the next "
             "round ends at this round's limit", VG, "ended = r.finished and not r.ids", "ended = r.finished",
             ("tests/vllm_engine/test_vllm_rollout_budget.py::test_budgeted_rounds_equal_one_unbudgeted_greedy_decode",),
             venv="vllm"),
    Mutation("10b", "checkpoint barrier removed from save_rollouts", CR,
             'os.replace(path + ".tmp", path)\n    trainer.accelerator.wait_for_everyone()',
             'os.replace(path + ".tmp", path)',
             ("tests/test_budget_sigkill.py::test_no_trainer_state_before_every_ranks_rollouts",)),
    Mutation("10c", "server mode: every rank handed rank 0's share", SG,
             "mine = slice(self.accelerator.process_index * len(prompts), (self.accelerator.process_index + 1) * "
             "len(prompts))", "mine = slice(0, len(prompts))", (SERVER_2,)),
    # issue 65 item 3: truncated sampling, one distribution
    Mutation("11a", "log Z added to the old log-probs instead of subtracted (the behaviour's sign flipped)", TSM,
             "return logps - log_z, entropies, aux", "return logps + log_z, entropies, aux", (TS_TRAINER,)),
    Mutation("11b", "min_p alone does not count as truncation (log Z skipped)", OT,
             "return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0",
             "return self.top_k > 0 or self.top_p < 1.0",
             (TS + "test_the_corrected_ratio_is_one_on_policy_where_the_uncorrected_sits_at_the_kept_mass[min_p]",)),
    Mutation("11c", "top_k keeps k - 1 tokens (threshold off by one)", OT, "dim=-1).values[..., -1:]",
             "dim=-1).values[..., -2:-1]", (TS + "test_the_support_is_the_samplers[top_k]",)),
    Mutation("11d", "top_p cut at p instead of 1 - p", OT, "cumsum(-1) <= 1 - p", "cumsum(-1) <= p",
             (TS + "test_the_support_is_the_samplers[top_p]",)),
    Mutation("11e", "vLLM's order and transformers' swapped in the support rule", OT,
             "[min_p, *steps] if truncation.min_p_first else [*steps, min_p]",
             "[*steps, min_p] if truncation.min_p_first else [min_p, *steps]",
             (TS + "test_the_support_is_the_samplers[all_vllm]",)),
    Mutation("11f", "continuous batching's truncation read with vLLM's order", TSM,
             "min_p=float(g.min_p or 0.0), min_p_first=False)", "min_p=float(g.min_p or 0.0), min_p_first=True)",
             (TS + "test_each_route_reads_its_samplers_truncation",)),
    Mutation("11g", "the loss keeps old - log Z as its old log-probs (not restored)", TSM,
             'output["old_per_token_logps"] = old  #', "pass  #", (TS_TRAINER,)),
    # issue 66: dynamic sampling
    Mutation("66a", "equal rewards by an absolute tolerance (TRL's), not one relative to the rewards' scale", DS,
             "return ~(spread > RTOL * scale) | ~scored.any(dim=1)", "return ~(spread > 1e-8) | ~scored.any(dim=1)",
             (DS_T + "test_flat_groups_is_exact_equality_up_to_the_rewards_scale",)),
    Mutation("66b", "the refill cursor never moves: every round samples the same prompts", DS,
             "self.cursor += groups * world", "pass",
             (DS_T + "test_refill_prompts_go_through_the_dataset_once_a_pass_and_ranks_take_apart",)),
    Mutation("66c", "the refill cursor not restored on resume", DS,
             'self.source.cursor = int(state["prompts_taken"])', "pass",
             (DS_T + "test_a_resumed_run_samples_the_refills_of_the_uninterrupted_one",)),
    Mutation("66d", "the merged batch keeps the first round's num_items_in_batch", DS,
             'merged["num_items_in_batch"] = trainer.accelerator.gather(loss_mask.sum()).sum()', "pass",
             (DS_T + "test_kept_groups_train_as_trls_trainer_fed_those_groups",)),
    Mutation("66e", "each process refills only what it lacks (rounds out of lockstep)", DS,
             'return int(trainer.accelerator.reduce(t, reduction="max").item())', "return need",
             ("tests/test_dynamic_sampling_distributed.py::test_two_ranks_refill_in_lockstep_under_zero3",)),
    # issue 65: routing replay and the mismatch figures
    Mutation("65a", "replayed experts weighted by the router's own top-k gates, not recomputed at the recorded ones",
             RR, "return logits, gates(router, logits, idx), idx", "return logits, scores, idx",
             (REPLAY + "test_replay_is_transformers_router_with_its_topk_forced",)),
    Mutation("65b", "packed routing shifted by one token", LP,
             "packed = routing.indices[idx][attention_mask[idx].bool().to(idx.device)]",
             "packed = routing.indices[idx][attention_mask[idx].bool().to(idx.device)].roll(1, 0)",
             (REPLAY + "test_the_log_prob_passes_replay_each_rows_record",)),
    Mutation("65c", "replay skipped on the no-grad passes (old policy, reference)", LP,
             "routing = records.for_rows(input_ids, attention_mask) if records is not None else None",
             "routing = records.for_rows(input_ids, attention_mask) if records is not None and "
             "torch.is_grad_enabled() else None", (REPLAY + "test_the_log_prob_passes_replay_each_rows_record",)),
    Mutation("65d", "k3 estimate with the sign of d flipped", "grpo_accel/trainer/mismatch.py",
             "(torch.expm1(d) - d)", "(torch.expm1(d) + d)",
             (REPLAY + "test_the_k3_estimate_is_the_kl_of_the_behaviour_from_the_trainer",)),
    Mutation("65e", "captured routing shifted by one token (a span's start one past its first position)", RC,
             "f.state.position_offset - f.query_length, f.query_length)",
             "f.state.position_offset - f.query_length + 1, f.query_length)",
             (CAPTURE + "test_a_forked_group_records_the_samplers_routing_at_every_fed_token",)),
    Mutation("65f", "positions a request did not compute (forked prompt, prefix-cache pages) left unfilled", RC,
             "src = self.sources.get(hashes[p])", "src = None",
             (CAPTURE + "test_a_forked_group_records_the_samplers_routing_at_every_fed_token",)),
    Mutation("65g", "a carried completion's prefix takes the newer round's routing, not its first",
             "grpo_accel/generation/rollouts.py", "torch.where(kept[:n] >= 0, kept[:n], out[:n])",
             "torch.where(out[:n] >= 0, out[:n], kept[:n])",
             (CAPTURE + "test_a_rollout_keeps_each_positions_first_routing_and_a_checkpoint_keeps_it",)),
    Mutation("65h", "the budget's ready groups' routing not handed to the trainer's records", CR,
             "keep_routing(trainer, [p + r.completion_ids for p, r in rows], [r.routed_experts for _, r in rows])",
             "pass", (CAPTURE + "test_the_trainer_replays_the_samplers_routing",)),
    Mutation("66f", "a refill round on a budget samples its own prompts alone (the groups in flight not taken first)",
             CR, "        self.rollouts.add_prompts(prompt_ids, unique)\n        return self._step_and_score(",
             "        return score(inputs)\n        return self._step_and_score(",
             (DS_T + "test_on_a_rollout_budget_refill_rounds_join_the_groups_in_flight",)),
    Mutation("66g", "a refill round on a budget re-admits the step's batch (as the step's first round does)", CR,
             "        return self._step_and_score(trainer, len(unique), score)\n\n    def _step_and_score",
             "        return self.generate_and_score(trainer, inputs, score)\n\n    def _step_and_score",
             (DS_T + "test_on_a_rollout_budget_refill_rounds_join_the_groups_in_flight",)),
    Mutation("66h", "a server's refill round takes the batch asked for ahead (dropped: not its prompts)", SG,
             "and self.training() and not self._now:", "and self.training():",
             (SERVER + "test_dynamic_sampling_refills_now_and_keeps_the_batch_asked_ahead",)),
    Mutation("cb-race", "a round's requests queued while transformers' loop runs: it may take them in several drains",
             "grpo_accel/generation/continuous_batching.py", "    with manager.pause():\n        yield",
             "    yield", ("tests/test_continuous_batching.py::test_a_rounds_requests_enter_the_loop_together",)),
]


def scratch_copy(root: str) -> str:
    """The checkout's tracked and untracked (not ignored) files in a new temporary folder."""
    files = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=root, check=True,
                           capture_output=True).stdout.decode().split("\0")
    dest = tempfile.mkdtemp(prefix="grpo_accel-mutations-")
    for rel in filter(None, files):
        src, dst = os.path.join(root, rel), os.path.join(dest, rel)
        if os.path.islink(src) or os.path.isfile(src):  # a link stays a link (accelerate_configs: a folder's)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.symlink(os.readlink(src), dst) if os.path.islink(src) else shutil.copy2(src, dst)
    return dest


def pytest(python: str, tree: str, tests: tuple[str, ...], timeout_s: int) -> tuple[int, str, float]:
    """(pytest's exit code, its output, seconds) of `tests` run in `tree` (the scratch copy), one process, one thread:
    code 1 is a failed test; 0 passed or skipped; others (2 interrupted or a collection error, 5 nothing collected)
    are no verdict."""
    mark = f"{MARK}={os.getpid()}-{time.monotonic_ns()}"
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("TEST_THREADS", "1"), HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONPATH=tree, **dict([mark.split("=", 1)]))
    t0 = time.monotonic()
    # its own session: Ctrl-C reaches this script only, which ends pytest and what it launched
    proc = subprocess.Popen([python, "-m", "pytest", "-q", "-x", "-p", "no:xdist", "-p", "no:cacheprovider",
                             "--timeout", str(timeout_s), *tests], cwd=tree, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            end_marked(mark)
    return proc.returncode, output, time.monotonic() - t0


MARK = "GRPO_ACCEL_MUTATION_RUN"  # in the environment of every process a selection starts, and of theirs


def end_marked(mark: str) -> None:
    """SIGKILL every process whose environment holds `mark`: what an interrupted selection launched in sessions of
    its own (support.launch's process groups, accelerate's ranks), which ending pytest's group leaves running."""
    needle = (mark + "\0").encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read() + b"\0" and int(pid) != os.getpid():
                    os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError):  # gone, or not ours to read
            pass


def failure_line(output: str) -> str:
    """The first failed test and the first line of its error."""
    lines = output.splitlines()
    failed = [ln.split(" - ")[0] for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    error = [ln[1:].strip() for ln in lines if ln.startswith("E ")]
    return " ".join([*failed[:1], *(f"({e[:160]})" for e in error[:1])]) or (lines[-1][:200] if lines else "")


class Interrupted(Exception):
    pass


def _on_sigterm(signum, frame):
    raise Interrupted("SIGTERM")


def apply(tree: str, m: Mutation) -> str | None:
    """Put `m` into the tree: the file's original text, or None where the pattern is not found exactly once."""
    path = os.path.join(tree, m.path)
    with open(path) as f:
        original = f.read()
    if original.count(m.pattern) != 1:
        return None
    with open(path, "w") as f:
        f.write(original.replace(m.pattern, m.replacement))
    return original


def restore(tree: str, m: Mutation, original: str) -> None:
    with open(os.path.join(tree, m.path), "w") as f:
        f.write(original)


def check(mutations: list[Mutation], tree: str, pythons: dict[str, str | None], baseline: bool = True,
          timeout_s: int = 900, say=print) -> dict[str, list[str]]:
    """Each mutation in `tree` in turn; the verdicts by kind: killed, survived, unmatched, errored, skipped (no venv),
    and broken (the selection failed unmutated)."""
    out = {k: [] for k in ("killed", "survived", "unmatched", "errored", "skipped", "broken")}
    runnable = []
    for m in mutations:
        if pythons.get(m.venv) is None:
            out["skipped"].append(m.name)
            say(f"[mutations] {m.name}: skipped, needs {VENVS[m.venv]} (not built here: make setup-vllm)")
        else:
            runnable.append(m)
    if baseline:
        broken = set()
        for venv, tests in dict.fromkeys((m.venv, m.tests) for m in runnable):
            rc, output, took = pytest(pythons[venv], tree, tests, timeout_s)
            say(f"[mutations] unmutated {' '.join(t.split('::')[-1] for t in tests)}: "
                f"{'passed' if rc == 0 else f'exit {rc}'} ({took:.0f} s)")
            if rc != 0:
                broken.add((venv, tests))
                say(f"[mutations]   {failure_line(output)}; its output's end:\n{output[-3000:]}")
        for m in [m for m in runnable if (m.venv, m.tests) in broken]:
            out["broken"].append(m.name)
            runnable.remove(m)
    for m in runnable:
        original = apply(tree, m)
        if original is None:
            out["unmatched"].append(m.name)
            say(f"[mutations] {m.name}: UNMATCHED, its pattern is not in {m.path} exactly once: update the row")
            continue
        try:
            rc, output, took = pytest(pythons[m.venv], tree, m.tests, timeout_s)
        finally:
            restore(tree, m, original)
        verdict = {0: "survived", 1: "killed"}.get(rc, "errored")
        out[verdict].append(m.name)
        tail = output.strip().splitlines()[-1] if output.strip() else ""
        detail = failure_line(output) if rc == 1 else f"its tests {'skipped' if 'skipped' in tail else 'passed'}: " \
            f"{tail}" if rc == 0 else f"pytest exit {rc}: {failure_line(output)}"
        say(f"[mutations] {m.name}: {verdict.upper()} ({took:.0f} s; {m.what}): {detail}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", metavar="NAME", help="these mutations only (see --list)")
    ap.add_argument("--list", action="store_true", help="print the mutations and their tests, run nothing")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated runs of each selection")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per test (pytest-timeout)")
    args = ap.parse_args(argv)
    names = [m.name for m in MUTATIONS]
    unknown = set(args.only or ()) - set(names)
    if unknown:
        ap.error(f"no mutation {sorted(unknown)}: the names are {names}")
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name:11} {m.venv:5} {m.path}: {m.what}\n{'':18}{' '.join(m.tests)}")
        return 0
    pythons = {}
    for key, venv in VENVS.items():
        python = os.path.join(ROOT, venv, "bin", "python")
        pythons[key] = python if os.path.exists(os.path.join(ROOT, venv, ".installed-stamp")) else None
    signal.signal(signal.SIGTERM, _on_sigterm)
    t0, tree = time.monotonic(), scratch_copy(ROOT)
    print(f"[mutations] {len(chosen)} mutation(s) in a scratch copy of the checkout: {tree}")
    try:
        out = check(chosen, tree, pythons, baseline=not args.no_baseline, timeout_s=args.timeout)
    except (KeyboardInterrupt, Interrupted):
        print("[mutations] interrupted: the scratch copy is deleted, the working tree was never edited")
        return 130
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    took = time.monotonic() - t0
    print(f"[mutations] {len(out['killed'])} killed, {len(out['survived'])} survived, {len(out['unmatched'])} "
          f"unmatched, {len(out['errored'])} errored, {len(out['broken'])} not checked (their tests fail unmutated), "
          f"{len(out['skipped'])} skipped (no venv) in {int(took) // 60} min {int(took) % 60} s")
    bad = {k: out[k] for k in ("survived", "unmatched", "errored", "broken") if out[k]}
    if out["skipped"]:
        print(f"[mutations] skipped, their venv not built here: {' '.join(out['skipped'])}")
    if bad:
        print("[mutations] FAILED: " + "; ".join(f"{k}: {' '.join(v)}" for k, v in bad.items()))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
