"""epmoe: expert-parallel Mixture-of-Experts (Python API shaped like Dist-MoE's).

    config = epmoe.Config(max_num_local_input_tokens=T, hidden_dim=D, intermediate_dim=F,
                          top_k=K, num_experts=E_global)
    print(epmoe.plan_memory(config, ep_size).explain())
    context = epmoe.create_context(group, config, device)
    y_TD = epmoe.routed_experts(x_TD, topk_ids_TK, topk_scores_TK, w13, w2, context)
    context.close()

Importing initialises neither CUDA nor a process group. See docs/python.md.
"""

from ._lib import library_path
from .api import ExecutionOptions, routed_experts
from .config import Config
from .context import Context, create_context
from .layered import DispatchHandle, combine, dispatch, grouped_gemm
from .plan import MemoryPlan, explain_kernels, plan_memory

__all__ = [
    "Config",
    "Context",
    "DispatchHandle",
    "ExecutionOptions",
    "MemoryPlan",
    "combine",
    "create_context",
    "dispatch",
    "explain_kernels",
    "grouped_gemm",
    "library_path",
    "plan_memory",
    "routed_experts",
]
__version__ = "0.1.0"
