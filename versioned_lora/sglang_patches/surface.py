"""Every SGLang name the patches replace, call or read, with the version each was read against (issue 46, item 6).

The patches reach into SGLang's internals; a release that renames or removes one of these breaks them, often
far from the patch (a load that answers success=False, a reclaim that never sees its refcount drop). This
table is the whole surface: tests/sglang_patches/test_sglang_surface.py fails if an entry is missing from the
installed SGLang, and if a `replace_attribute` call in the patches names a target this table does not list.
docs/integration.md, "When SGLang moves", says which in-flight SGLang changes touch which rows.

A target is ``module:Qualname.attr``; `kind` says how the patches use it:
- ``replaced``: the patches set it (`mechanism.replace_attribute`);
- ``called``: the patches call it (a function, a method, a class they construct);
- ``field``: a dataclass field or an instance attribute the patches read or pass (checked in the class's
  fields, or as ``self.<attr> =`` in its source);
- ``communicator``: a ``TokenizerManager.<name>_communicator`` the patches await, which SGLang creates from an
  entry of ``_COMMUNICATOR_SPECS`` (checked there).
"""

from __future__ import annotations

import attrs

from versioned_lora.sglang_patches.mechanism import SUPPORTED_SGLANG_VERSION


@attrs.frozen
class SGLangUse:
    target: str  # "module:Qualname.attr"
    kind: str  # "replaced" | "called" | "field" | "communicator"
    where: str  # the patch module that uses it
    guard: str = SUPPORTED_SGLANG_VERSION  # the SGLang release it was read against (mechanism's version guard)

    @property
    def module(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def path(self) -> tuple[str, ...]:
        return tuple(self.target.split(":", 1)[1].split("."))


_TM = "sglang.srt.managers.tokenizer_manager:TokenizerManager"
_REGISTRY = "sglang.srt.lora.lora_registry:LoRARegistry"
_HTTP = "sglang.srt.entrypoints.http_server"
_IO = "sglang.srt.managers.io_struct"
_POOL = "sglang.srt.lora.mem_pool:LoRAMemoryPool"

SGLANG_SURFACE: tuple[SGLangUse, ...] = (
    # ---- replaced
    SGLangUse(f"{_TM}.load_lora_adapter", "replaced", "managed/guards.py"),
    SGLangUse(f"{_TM}.load_lora_adapter_from_tensors", "replaced", "managed/guards.py"),
    SGLangUse(f"{_TM}.unload_lora_adapter", "replaced", "managed/guards.py"),
    SGLangUse(f"{_TM}._resolve_lora_path", "replaced", "managed/guards.py"),
    SGLangUse(f"{_TM}._validate_one_request", "replaced", "managed/generate_gate.py"),
    SGLangUse(f"{_TM}.pause_generation", "replaced", "managed/audit.py"),
    SGLangUse(f"{_TM}.continue_generation", "replaced", "managed/audit.py"),
    SGLangUse(f"{_TM}.flush_cache", "replaced", "managed/audit.py"),
    SGLangUse(f"{_TM}.update_weights_from_disk", "replaced", "managed/audit.py"),
    SGLangUse(f"{_TM}.update_weights_from_distributed", "replaced", "managed/audit.py"),
    SGLangUse(f"{_TM}.update_weights_from_tensor", "replaced", "managed/audit.py"),
    SGLangUse(f"{_TM}.update_weights_from_ipc", "replaced", "managed/audit.py"),
    SGLangUse(f"{_TM}.abort_request", "replaced", "managed/audit.py"),
    SGLangUse(f"{_REGISTRY}.acquire", "replaced", "managed/__init__.py"),
    SGLangUse(f"{_REGISTRY}.release", "replaced", "managed/__init__.py"),
    SGLangUse(f"{_REGISTRY}.lru_lora_name", "replaced", "managed/guards.py"),
    SGLangUse(f"{_HTTP}:generate_contract_error", "replaced", "managed/generate_gate.py"),
    SGLangUse(f"{_HTTP}:add_prometheus_middleware", "replaced", "managed/metrics.py"),
    SGLangUse(f"{_HTTP}:validation_exception_handler", "replaced", "managed/generate_envelope.py"),
    SGLangUse(f"{_HTTP}:serve_generate_request", "replaced", "managed/generate_envelope.py"),
    SGLangUse(f"{_HTTP}:_create_error_response", "replaced", "managed/generate_envelope.py"),
    SGLangUse(f"{_HTTP}:_setup_and_run_http_server", "replaced", "server.py"),  # the warm standby
    SGLangUse("sglang.srt.managers.scheduler:Scheduler.init_request_dispatcher", "replaced",
              "managed/scheduler_side.py"),
    SGLangUse("sglang.srt.managers.tp_worker:TpModelWorker.load_lora_adapter_from_tensors", "replaced",
              "managed/scheduler_side.py"),
    SGLangUse("sglang.srt.lora.layers:torch", "replaced", "cpu_compat.py"),
    SGLangUse("sglang.srt.lora.backend.torch_backend:torch", "replaced", "cpu_compat.py"),
    SGLangUse("sglang.srt.lora.lora:torch", "replaced", "cpu_compat.py"),
    SGLangUse("sglang.srt.layers.rotary_embedding.base:_is_cpu", "replaced", "cpu_compat.py"),
    SGLangUse("sglang.srt.layers.rotary_embedding.base:_is_cpu_amx_available", "replaced", "cpu_compat.py"),
    # a CPU host's engine forks its children from a fork server (faster starts); the original still runs first
    SGLangUse("sglang.srt.entrypoints.engine:_set_envs_and_config", "replaced", "cpu_compat.py"),
    # test-only (the "test_faults" set): flip a byte of an armed adapter's slot after SGLang's copy into the pool
    SGLangUse(f"{_POOL}.load_lora_weight_to_buffer", "replaced", "managed/served_faults.py"),
    # ---- called
    SGLangUse("sglang.srt.model_executor.model_runner:ModelRunner.load_lora_adapter_from_tensors", "called",
              "managed/scheduler_side.py"),
    SGLangUse(f"{_REGISTRY}.wait_for_unload", "called", "managed/engine_side.py"),
    SGLangUse(f"{_REGISTRY}.unregister", "called", "managed/engine_side.py"),
    SGLangUse(f"{_TM}.generate_request", "called", "managed/engine_side.py"),
    SGLangUse(f"{_HTTP}:get_global_state", "called", "managed/__init__.py"),
    SGLangUse(f"{_HTTP}:launch_server", "called", "server.py"),
    SGLangUse("sglang.srt.server_args:prepare_server_args", "called", "server.py"),
    SGLangUse("sglang.srt.managers.scheduler:run_scheduler_process", "called", "process_entry.py"),
    SGLangUse("sglang.srt.managers.detokenizer_manager:run_detokenizer_process", "called", "process_entry.py"),
    SGLangUse("sglang.srt.runtime_context:get_lora", "called", "managed/endpoints.py"),
    SGLangUse("sglang.srt.runtime_context:get_device", "called", "managed/scheduler_side.py"),
    SGLangUse("sglang.srt.runtime_context:get_server_args", "called", "managed/scheduler_side.py"),
    SGLangUse("sglang.srt.utils.common:init_custom_process_group", "called", "adapters/transfer.py"),
    SGLangUse(f"{_IO}:LoadLoRAAdapterReqInput", "called", "managed/staging.py"),
    SGLangUse(f"{_IO}:LoadLoRAAdapterFromTensorsReqInput", "called", "managed/staging.py"),
    SGLangUse(f"{_IO}:LoadLoRAAdapterFromTensorsReqInput.to_ref", "called", "managed/scheduler_side.py"),
    SGLangUse(f"{_IO}:UnloadLoRAAdapterReqInput", "called", "managed/engine_side.py"),
    SGLangUse(f"{_IO}:LoRAUpdateOutput", "called", "managed/guards.py"),
    SGLangUse(f"{_IO}:GenerateReqInput", "called", "managed/engine_side.py"),
    SGLangUse(f"{_POOL}.get_buffer_id", "called", "managed/served_readback.py"),
    # ---- fields and instance attributes
    SGLangUse(f"{_IO}:LoadLoRAAdapterFromTensorsReqInput.load_format", "field", "managed/staging.py"),
    SGLangUse(f"{_IO}:LoadLoRAAdapterFromTensorsReqInput.serialized_named_tensors", "field", "managed/staging.py"),
    SGLangUse(f"{_IO}:LoadLoRAAdapterFromTensorsReqInput.pinned", "field", "managed/staging.py"),
    SGLangUse(f"{_IO}:LoadLoRAAdapterReqInput.pinned", "field", "managed/staging.py"),
    SGLangUse(f"{_IO}:UnloadLoRAAdapterReqInput.lora_id", "field", "managed/engine_side.py"),
    SGLangUse(f"{_TM}.lora_registry", "field", "managed/engine_side.py"),
    SGLangUse(f"{_TM}.lora_update_lock", "field", "managed/engine_side.py"),
    SGLangUse(f"{_TM}.lora_ref_cache", "field", "managed/engine_side.py"),
    SGLangUse("sglang.srt.managers.tokenizer_control_mixin:_COMMUNICATOR_SPECS.update_lora_adapter", "communicator",
              "managed/engine_side.py"),  # TokenizerManager.update_lora_adapter_communicator, set from this spec
    SGLangUse(f"{_TM}.rid_to_state", "field", "introspection.py"),
    SGLangUse(f"{_TM}.model_config", "field", "managed/generate_gate.py"),
    SGLangUse(f"{_TM}.context_len", "field", "managed/generate_gate.py"),
    SGLangUse(f"{_REGISTRY}._registry", "field", "managed/engine_side.py"),
    SGLangUse(f"{_REGISTRY}._counters", "field", "managed/engine_side.py"),
    SGLangUse("sglang.srt.managers.tp_worker:TpModelWorker.model_runner", "field", "managed/scheduler_side.py"),
    # the read-back of a loaded adapter from the LoRA memory pool (served digest, issue 46 item 1)
    SGLangUse("sglang.srt.managers.scheduler:Scheduler.tp_worker", "field", "managed/scheduler_side.py"),
    SGLangUse("sglang.srt.model_executor.model_runner:ModelRunner.lora_manager", "field", "managed/scheduler_side.py"),
    SGLangUse("sglang.srt.lora.lora_manager:LoRAManager.memory_pool", "field", "managed/served_readback.py"),
    SGLangUse("sglang.srt.lora.lora_manager:LoRAManager.loras", "field", "managed/served_readback.py"),
    SGLangUse(f"{_POOL}.A_buffer", "field", "managed/served_readback.py"),
    SGLangUse(f"{_POOL}.B_buffer", "field", "managed/served_readback.py"),
    SGLangUse(f"{_POOL}.uid_to_buffer_id", "field", "managed/served_readback.py"),
    SGLangUse(f"{_POOL}.dtype", "field", "managed/served_readback.py"),
    SGLangUse("sglang.srt.lora.lora:LoRAAdapter.config", "field", "managed/served_readback.py"),
    SGLangUse("sglang.srt.lora.lora:LoRAAdapter.scaling", "field", "managed/served_readback.py"),
    SGLangUse("sglang.srt.lora.lora_config:LoRAConfig.r", "field", "managed/served_readback.py"),
    SGLangUse("sglang.srt.lora.lora_config:LoRAConfig.lora_alpha", "field", "managed/served_readback.py"),
    SGLangUse("sglang.srt.lora.lora_config:LoRAConfig.target_modules", "field", "managed/served_readback.py"),
    SGLangUse("sglang.srt.lora.lora_registry:LoRARef.lora_id", "field", "introspection.py"),
    SGLangUse("sglang.srt.lora.lora_registry:LoRARef.pinned", "field", "introspection.py"),
    SGLangUse("sglang.srt.lora.lora_registry:LoRARef.lora_path", "field", "introspection.py"),
    SGLangUse("sglang.srt.managers.tokenizer_manager:ReqState.dispatched", "field", "introspection.py"),
    SGLangUse("sglang.srt.managers.tokenizer_manager:ReqState.finished", "field", "introspection.py"),
    # read through runtime_context.get_lora(), the "lora" bag SGLang publishes from these server arguments
    SGLangUse("sglang.srt.server_args:ServerArgs.max_lora_rank", "field", "managed/endpoints.py"),
    SGLangUse("sglang.srt.server_args:ServerArgs.max_loaded_loras", "field", "managed/endpoints.py"),
    SGLangUse("sglang.srt.server_args:ServerArgs.lora_target_modules", "field", "managed/endpoints.py"),
    SGLangUse("sglang.srt.server_args:ServerArgs.tp_size", "field", "managed/scheduler_side.py"),
)
