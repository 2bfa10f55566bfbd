"""Every GRPOConfig field of the pinned TRL, and what our savers do with it: the drop-in promise as data.

Statuses:
  compared      tests/test_trl_compat.py runs the named cases through TRL's GRPOTrainer and ours (savers on) and
                finds the same metrics and the same parameter update;
  vllm tier     the colocated shared-weight engine's path, run in `make test-vllm` (tests/vllm_engine/);
  refused       construction stops with one `error:` line naming the field and the saver;
  not affected  the field acts where no saver of ours does (generation backends, logging, model loading);
  own path      ours runs instead of TRL's code for the field (TRL's has a bug): the named test compares the two
                where TRL's is correct;
  pending       not yet run with our savers on: the reason says what it needs.

`python -m grpo_accel.trainer.trl_compat` prints the table docs/trl-compatibility.md holds (a test compares them).
"""

from __future__ import annotations

TRL_VERSION = "1.16"
STATUSES = ("compared", "vllm tier", "refused", "not affected", "own path", "pending")

_GEN = "generation: TRL's own code (our savers act on the log-prob and training passes)"
_LOG = "logging of completions: TRL's own code"
_SERVER = ("vllm_mode='server': TRL's client generates and the savers run on the training side as in every case; "
           "needs a running `trl vllm-serve` (a GPU machine)")
_SERVER_LORA = ("vllm_mode='server' with LoRA/QLoRA: ours runs instead of TRL's merge-and-NCCL client "
                "(server_generation.py: the adapter alone loaded by `vllm serve` at run time, the next batch "
                "sampled while a step trains) and reads {what}; tests/test_server_generation.py: the steps equal "
                "TRL's GRPOTrainer fed the same completions and behaviour log-probs, bit for bit; "
                "tests/vllm_engine/test_vllm_server.py: launch/train.py through a real `vllm serve` with every saver. "
                "Full fine-tuning keeps TRL's client and `trl vllm-serve`: pending (a GPU machine)")
_COLOCATE_REFUSED = ("with vllm_mode='colocate' the shared-weight engine refuses a value other than the default, "
                     "naming the field (vllm_colocate.UNSUPPORTED_OPTIONS); vllm_mode='server' takes it")
_IS = ("on by default: every colocated run of the vLLM tier corrects with the shared engine's own sampling "
       "log-probs (SharedVLLMGeneration.generate returns them to TRL); not compared with TRL's engine")
_PAGED = ("route continuous_batching (issue 45): TRL 1.16's branch casts the model .to(bfloat16) under bf16 before "
          "generate_batch (a LoRA adapter's fp32 weights stay bf16); ours generates from the weights as they are "
          "(trainer/paged_generation.py), steps packing's attention back to SDPA for the paged path and sizes "
          "num_blocks from the plan. fp32 full fine-tuning, where TRL's branch casts nothing: one step equals TRL's "
          "(tests/test_continuous_batching.py); through the command (launch/train.py, fp32 LoRA, every CPU saver on, "
          "the pool by flag, 2 Adam steps): the same completions token for token and every logged figure as TRL's "
          "(tests/test_continuous_batching_command.py). QLoRA (NF4 base): TRL's branch runs it but casts in place "
          "what its half dtype does not match (fp16 run: the bf16 adapter becomes fp16; bf16 run over an fp32-loaded "
          "base: embeddings and norms become bf16); ours generates paged and trains with the adapter's dtype and the "
          "whole base byte for byte as loaded (same file). No behaviour log-probs, as TRL's: the sampler is the "
          "trained policy")
# field -> (status, cases or why). For "compared" the text starts with the case ids of tests/test_trl_compat.py.
FIELDS: dict[str, tuple[str, str]] = {
    "model_init_kwargs": ("compared", "kl_full_reference; TRL loads the model (and its reference) by path with them"),
    "trust_remote_code": ("not affected", "model loading: TRL's own code"),
    "router_aux_loss_coef": ("refused", "MoE router loss with activation offload (the offloaded re-run drops the "
                                        "router logits' gradient): stops naming --router_aux_loss_coef 0; with "
                                        "offload off our head, packing and shared prompt compute it and equal "
                                        "TRL's step (tests/test_moe.py)"),
    "disable_dropout": ("compared", "sampling"),
    "cast_lm_head_to_fp32": ("compared", "chat_kwargs_fp32_head; fp32 model (a bf16 model's case is a GPU row)"),
    "num_generations": ("compared", "default; 2 per prompt in every case"),
    "num_generations_eval": ("compared", "evaluation"),
    "max_completion_length": ("compared", "default; 8 tokens in every case, longer rows than one 16-token tile"),
    "ds3_gather_for_generation": ("not affected", _GEN),
    "shuffle_dataset": ("compared", "sampling"),
    "pad_to_multiple_of": ("compared", "sampling; packed rows carry no padding, TRL's padded rows do"),
    "generation_batch_size": ("compared", "sampling"),
    "steps_per_generation": ("compared", "iterations_entropy"),
    "temperature": ("compared", "sampling; the fused head divides the logits by it as TRL does"),
    "top_p": ("compared", "sampling"),
    "top_k": ("compared", "sampling"),
    "min_p": ("compared", "sampling"),
    "generation_kwargs": ("compared", "sampling"),
    "chat_template_kwargs": ("compared", "chat_kwargs_fp32_head"),
    "repetition_penalty": ("compared", "sampling"),
    "cache_implementation": ("not affected", _GEN),
    "use_vllm": ("vllm tier", "vllm_mode='colocate': our shared-weight engine in place of TRL's "
                              "(tests/vllm_engine/test_vllm_trl.py: one real GRPO step through TRL's loop)"),
    "vllm_mode": ("vllm tier", "'colocate': our engine; 'server': with LoRA ours (vllm_server_base_url's row), "
                               "full fine-tuning: " + _SERVER),
    "vllm_model_impl": ("refused", _COLOCATE_REFUSED),
    "vllm_enable_sleep_mode": ("refused", _COLOCATE_REFUSED + "; the engine sleeps by itself where its weights are "
                                          "its own (full fine-tuning on CUDA)"),
    "vllm_structured_outputs_regex": ("refused", _COLOCATE_REFUSED),
    "vllm_server_base_url": ("own path", _SERVER_LORA.format(what="the address from it")),
    "vllm_server_host": ("own path", _SERVER_LORA.format(what="the address from it and vllm_server_port when "
                                                                "vllm_server_base_url is unset")),
    "vllm_server_port": ("own path", _SERVER_LORA.format(what="the address from it and vllm_server_host when "
                                                                "vllm_server_base_url is unset")),
    "vllm_server_timeout": ("own path", _SERVER_LORA.format(what="it as the bound of each request (an adapter "
                                                                   "load, a batch's sampling): a dead or slow server "
                                                                   "is one error line within it "
                                                                   "(tests/test_adapter_sync.py)")),
    "vllm_group_port": ("pending", "TRL's NCCL weight-sync group: full fine-tuning through `trl vllm-serve` only "
                                   "(adapter sync has no NCCL group); needs a GPU machine"),
    "vllm_gpu_memory_utilization": ("vllm tier", "colocate: taken as given when set, else sized by the planner "
                                                 "(tests/test_vllm_setup.py)"),
    "vllm_max_model_length": ("vllm tier", "colocate: taken as given when set (tests/test_vllm_setup.py)"),
    "vllm_tensor_parallel_size": ("refused", _COLOCATE_REFUSED),
    "beta": ("compared", "kl_lora kl_full_reference sync_reference"),
    "num_iterations": ("compared", "iterations_entropy"),
    "epsilon": ("compared", "default; TRL's 0.2 in every case"),
    "delta": ("compared", "iterations_entropy"),
    "epsilon_high": ("compared", "iterations_entropy"),
    "sapo_temperature_neg": ("compared", "loss_sapo"),
    "sapo_temperature_pos": ("compared", "loss_sapo"),
    "vespo_k_pos": ("compared", "loss_vespo"),
    "vespo_lambda_pos": ("compared", "loss_vespo"),
    "vespo_k_neg": ("compared", "loss_vespo"),
    "vespo_lambda_neg": ("compared", "loss_vespo"),
    "importance_sampling_level": ("compared", "sequence_is_batch_scale default"),
    "reward_weights": ("compared", "trl_library_rewards"),
    "multi_objective_aggregation": ("compared", "normalize_then_sum trl_library_rewards"),
    "scale_rewards": ("compared", "sequence_is_batch_scale truncation_entropy_quantile default"),
    "loss_type": ("compared", "default loss_grpo loss_dr_grpo loss_bnpo loss_cispo loss_sapo loss_luspo loss_vespo; "
                             "default is dapo"),
    "mask_truncated_completions": ("compared", "truncation_entropy_quantile"),
    "sync_ref_model": ("compared", "sync_reference"),
    "ref_model_mixup_alpha": ("compared", "sync_reference"),
    "ref_model_sync_steps": ("compared", "sync_reference"),
    "top_entropy_quantile": ("compared", "truncation_entropy_quantile"),
    "entropy_coef": ("compared", "iterations_entropy"),
    "use_adaptive_entropy": ("compared", "iterations_entropy"),
    "entropy_coef_min": ("compared", "iterations_entropy; TRL's default bounds"),
    "entropy_coef_max": ("compared", "iterations_entropy; TRL's default bounds"),
    "entropy_coef_delta": ("compared", "iterations_entropy; TRL's default step"),
    "entropy_target": ("compared", "iterations_entropy; TRL's default target"),
    "max_tool_calling_iterations": ("compared", "tools; calls parsed from Qwen3's format, TRL's own tool loop"),
    "vllm_importance_sampling_correction": ("vllm tier", _IS),
    "vllm_importance_sampling_mode": ("vllm tier", _IS),
    "vllm_importance_sampling_clip_max": ("vllm tier", _IS),
    "vllm_importance_sampling_clip_min": ("vllm tier", _IS),
    "vllm_importance_sampling_cap": ("vllm tier", _IS),
    "off_policy_mask_threshold": ("compared", "iterations_entropy"),
    "use_bias_correction_kl": ("compared", "kl_full_reference kl_lora"),
    "log_completions": ("not affected", _LOG),
    "log_multimodal": ("not affected", _LOG),
    "num_completions_to_print": ("not affected", _LOG),
    "log_unique_prompts": ("not affected", _LOG),
    "log_completions_hub_repo": ("not affected", _LOG),
    "use_transformers_continuous_batching": ("own path", _PAGED),
    "transformers_continuous_batching_config": ("own path", "its num_blocks, page_size, max_batch_tokens win over the "
                                                            "plan's; the other fields reach ContinuousBatchingConfig "
                                                            "as given. On the command line a JSON object "
                                                            "(`--transformers_continuous_batching_config "
                                                            "'{\"num_blocks\": 16, \"page_size\": 32}'`), in a "
                                                            "--config YAML a mapping; a value that is neither, or a "
                                                            "key ContinuousBatchingConfig lacks, is refused before "
                                                            "loading (TRL's trainer failed after it, with a "
                                                            "traceback)"),
    "use_transformers_paged": ("not affected", _GEN),
}

# Trainer arguments beyond the config, in the same vocabulary.
TRAINER_ARGUMENTS: dict[str, tuple[str, str]] = {
    "reward_funcs (several, weighted)": ("compared", "trl_library_rewards normalize_then_sum"),
    "reward_funcs (trl.rewards: think format, soft overlong punishment, repetition penalty)": (
        "compared", "trl_library_rewards"),
    "reward_funcs (async def)": ("compared", "reward_kinds"),
    "reward_funcs (None for some rows)": ("compared", "reward_kinds"),
    "reward_funcs (a reward model) + reward_processing_classes": ("compared", "reward_model_plain_text"),
    "reward_funcs=None (environment rewards)": ("compared", "environment_rewards; the environment's get_reward"),
    "train_dataset (conversational / plain text)": ("compared", "default reward_model_plain_text"),
    "eval_dataset": ("compared", "evaluation"),
    "peft_config": ("compared", "kl_lora"),
    "rollout_func (with env_mask: environment tokens are context, not loss)": ("compared", "rollout_env_mask"),
    "tools / environment_factory (tool responses inside completions: context, not loss)": (
        "compared", "tools environment_rewards; Qwen3's chat template, generation scripted (a random tiny model "
                    "never writes a tool call)"),
}


def markdown_table() -> str:
    rows = [f"| `{name}` | {status} | {why} |" for name, (status, why) in FIELDS.items()]
    rows += [f"| {name} | {status} | {why} |" for name, (status, why) in TRAINER_ARGUMENTS.items()]
    return "\n".join([f"| GRPOConfig field (TRL {TRL_VERSION}) | status | cases, or why |", "| --- | --- | --- |",
                      *rows])


if __name__ == "__main__":
    print(markdown_table())
