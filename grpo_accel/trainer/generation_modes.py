"""One object per generation mode, owning its state; the one way a mode hooks into TRL.

The route is decided once, at start-up (planning.routes.choose_route, through vllm_setup.colocated_route); the trainer
then holds one mode (`GRPOAccelTrainer.generation_mode`) and forwards TRL's generation hooks to it:

    mode                     what generates                                         where
    GenerationMode (base)    TRL's own generate() (nothing of ours)                 here
    ContinuousBatchingMode   transformers' continuous batching, weights uncast      trainer/paged_generation.py
    ColocatedVLLMMode        the engine sharing the trainer's weights                here
    ServerMode               a `vllm serve` machine, the next batch asked ahead     trainer/server_mode.py
    BudgetMode               --rollout_budget: rounds on continuous batching or     trainer/carried_rollouts.py
                             colocated vLLM, groups carried across steps

The hooks (each a no-op, or TRL's own, in the base class): `generate_and_score` (TRL's
`_generate_and_score_completions`), `refill_and_score` (the same for dynamic sampling's refill rounds), `single_turn`
(its `_generate_single_turn`; None: TRL's own), `after_single_turn`, `read_ahead` (transformers' `get_batch_samples`
reading one generation batch early), `save` / `load` (checkpoints), `metrics` (each logged step), `close` (train()
ends).
"""

from __future__ import annotations

from grpo_accel.core.errors import ConfigError


def attach_to_trl(trainer, generation, vllm_mode: str) -> None:
    """Route a TRL 1.16 GRPOTrainer's generation through `generation` (an object with TRL's `sync_weights` and
    `generate`), the one place that writes TRL's generation state: `use_vllm` on (TRL then calls it, and applies its
    importance-sampling correction with the log-probs it returns), `vllm_mode`, `vllm_generation`, and
    `_last_loaded_step` -1 (TRL syncs before its first generation). The trainer must have been built with
    `use_vllm=False`, or TRL has started an engine or client of its own."""
    if getattr(trainer, "vllm_generation", None) is not None:
        raise ValueError("the trainer already has a vLLM engine (use_vllm=True): build it with use_vllm=False and "
                         "attach the shared engine afterwards, or it holds two engines")
    trainer.use_vllm = True
    trainer.vllm_mode = vllm_mode
    trainer.vllm_generation = generation
    trainer._last_loaded_step = -1


def sync_once_per_step(trainer) -> None:
    """TRL 1.16's sync before its vLLM generation (`_generate_single_turn`): once per optimizer step."""
    from trl.extras.profiling import profiling_context

    if trainer.state.global_step != trainer._last_loaded_step:
        with profiling_context(trainer, "sync_weights"):
            trainer.vllm_generation.sync_weights()
        trainer._last_loaded_step = trainer.state.global_step


def refuse_multi_turn(trainer, what: str, why: str, fix: str, *others: tuple[str, object]) -> None:
    """A mode that samples a batch in one request (ahead, or in rounds) cannot run TRL's tool loop, rollout_func or
    environments (nor `others`: (name, set) pairs): one error, "<what> cannot run with <name><why>. Fix: <fix>."."""
    for name, value in (("tools", trainer.tools), ("a rollout_func", trainer.rollout_func),
                        ("an environment_factory", trainer.environment_factories), *others):
        if value:
            raise ConfigError(f"{what} cannot run with {name}{why}. Fix: {fix}.")


class ReadAhead:
    """transformers' micro-batches of one optimizer step, read on past them to the next generation batch
    (`next_rows`): TRL generates at micro-steps that are multiples of steps_per_generation x num_iterations, so that
    batch is known one optimizer step early. Read-ahead batches are handed out in order later; at an epoch's end there
    is none (its first step samples synchronously). Used by the server (asks for it early) and the rollout budget
    (starts it early)."""

    def __init__(self):
        self.source, self.batches, self.next_rows = None, [], None

    def read(self, trainer, epoch_iterator, num_batches: int) -> list:
        if self.source is not epoch_iterator:
            self.source, self.batches = epoch_iterator, []
        ahead, exhausted = self.batches, False

        def pull() -> bool:
            nonlocal exhausted
            try:
                ahead.append(next(epoch_iterator))
            except StopIteration:
                exhausted = True
            return not exhausted

        while len(ahead) < num_batches and pull():
            pass
        batches = [ahead.pop(0) for _ in range(min(num_batches, len(ahead)))]
        every = trainer.args.steps_per_generation * trainer.num_iterations
        after = trainer._step + len(batches)  # the micro-step of the first batch not handed out
        index = -(-after // every) * every - after  # the next generation's batch, counted from there
        while len(ahead) <= index and not exhausted and pull():
            pass
        self.next_rows = ahead[index] if len(ahead) > index else None
        return batches

    def take_next_rows(self):
        """The next generation batch's rows (None at an epoch's last batch), handed out once."""
        rows, self.next_rows = self.next_rows, None
        return rows


class GenerationMode:
    """TRL's own generation: every hook is TRL's (the base of the modes, module docstring)."""

    read_ahead: ReadAhead | None = None  # set by a mode that reads the next generation batch early
    # why this route records no MoE routing for --routing_replay (None: it does, routing_capture.py)
    routing_blocker: str | None = ("route generate records no routing (transformers' generate() is not hooked); "
                                   "--use_transformers_continuous_batching true records it")

    def generate_and_score(self, trainer, inputs: list[dict], score):
        return score(inputs)

    def refill_and_score(self, trainer, inputs: list[dict], score):
        """A refill round of dynamic sampling (dynamic_sampling.py): further prompts, within the step that has its
        batch; what the mode holds for the steps ahead stays as it is."""
        return score(inputs)

    def single_turn(self, trainer, prompt_ids):
        return None

    def after_single_turn(self, trainer, num_generations: int) -> None:
        pass

    def save(self, trainer, checkpoint_dir: str) -> None:
        pass

    def load(self, trainer, checkpoint_dir: str) -> None:
        pass

    def metrics(self) -> dict:
        return {}

    def close(self) -> None:
        pass



class ColocatedVLLMMode(GenerationMode):
    """The in-process engine whose base weights are the trainer's (generation/vllm_colocate.py) as TRL's
    `vllm_generation`: TRL syncs (adapter only: SharedVLLMGeneration.sync_weights) and generates through it."""

    routing_blocker = ("the colocated vLLM engine's routing is not recorded yet (vLLM's enable_return_routed_experts "
                       "is not wired in); --use_vllm false --use_transformers_continuous_batching true records it")

    def __init__(self, trainer, engine):
        from grpo_accel.generation.vllm_colocate import unsupported_options
        from grpo_accel.generation.vllm_generation import SharedVLLMGeneration, sampling_settings

        refusal = unsupported_options(trainer.args)
        if refusal:
            raise ConfigError(refusal)
        self.engine = engine
        self.generation = SharedVLLMGeneration(engine, policy=lambda: trainer.accelerator.unwrap_model(trainer.model),
                                               sampling=sampling_settings(trainer.args))
        attach_to_trl(trainer, self.generation, "colocate")


def start_engine(model, args, trl_kwargs: dict):
    """(engine, model) for colocated generation, or (None, model) with one line when it cannot run here (then
    transformers' continuous batching where it runs, else TRL's generate())."""
    from grpo_accel.core.console import log
    from grpo_accel.generation.vllm_setup import colocated_route, start_colocated_engine

    peft_config = trl_kwargs.get("peft_config")
    action, route = colocated_route(model, args, lora_r=int(peft_config.r) if peft_config is not None else 0)
    if action == "fallback":
        log(route)  # the line: transformers' route and the package that would give this run an engine
        args.use_vllm = False
        args.use_transformers_continuous_batching = route.startswith("generation route continuous_batching:")
        return None, model
    return start_colocated_engine(model, args, peft_config=peft_config, route=route,
                                  train_dataset=trl_kwargs.get("train_dataset"),
                                  tokenizer=trl_kwargs.get("processing_class"))


def attach_shared_vllm(trainer, engine):
    """Route a TRL 1.16 GRPOTrainer's generation through a shared-weight `engine` (call right after the trainer's
    __init__, built with use_vllm=False from a model `engine.build_training_model()` returned): TRL's
    `_generate_single_turn` then calls our adapter-only `sync_weights` and `generate`. The object TRL calls."""
    return ColocatedVLLMMode(trainer, engine).generation


__all__ = ["ColocatedVLLMMode", "GenerationMode", "ReadAhead", "attach_shared_vllm", "attach_to_trl",
           "refuse_multi_turn", "start_engine", "sync_once_per_step"]
