"""Agents, an optional part (`pip install 'areal-flow[agents]'`): the OpenAI-compatible
endpoint a workflow's agent talks to (`openai_endpoint`), text environments and the `env`
workflow that plays them (`environment`, `env`), the calculator-tool workflow (`tool_use`) and
`verifiers` environments (`verifiers_env`). Workflows reach the core through the `workflows`
and `environments` registries; the core loads this folder only when an episode asks."""
