"""The worker side: the pass over a step's mirrors through vLLM's own modules, its fused
element-wise kernels, vLLM's KV layouts, the session store, seeded sampling rewound."""
