"""LoRA RL: train a PEFT adapter instead of every weight and serve it through vLLM's own LoRA support.

:mod:`vime_core.lora.options` holds the flags (upstream vime's names), their checks and the adapter naming; the
torch backend's PEFT model is :mod:`vime_core.trainer.lora_torch`, Megatron's :mod:`vime_core.trainer.megatron_lora`,
the engine side :mod:`vime_core.rollout.lora_serving`. How it fits together: docs/lora.md.
"""
