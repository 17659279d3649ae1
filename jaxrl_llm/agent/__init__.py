"""Agent rollouts: multi-turn agent loops (verl's AgentLoop) over the request-level rollout server.

An agent loop turns one data row into one trajectory by talking to `rollout.RolloutServer` in
token ids: generate, parse tool calls, run tools / a simulated user, append their tokens with
`response_mask = 0`, generate again. This package never touches device arrays or model code.
"""
from jaxrl_llm.agent._loop import (
    AGENT_LOOPS,
    TURN_ROW_STRIDE,
    AgentContext,
    AgentLoopBase,
    AgentLoopOutput,
    AgentSample,
    SingleTurnAgentLoop,
    ToolAgentLoop,
    get_agent_loop,
    register_agent_loop,
    truncate_text,
)
from jaxrl_llm.agent._openai_agent import OpenAIAgentLoop, close_openai_endpoint
from jaxrl_llm.agent._parsers import ToolCall, format_tool_call, get_tool_parser
from jaxrl_llm.agent._replay import dapo_group_filter, off_policy_metrics
from jaxrl_llm.agent._rollouter import (
    PromptGroup,
    ReplayBudgetError,
    Rollouter,
    TakenBatch,
    TrajectoryGroup,
    TrajectoryQueue,
    merge_windows,
    take_metrics,
)
from jaxrl_llm.agent._runner import AgentRunner, agent_metrics, load_agent_resources

__all__ = [
    "AGENT_LOOPS",
    "TURN_ROW_STRIDE",
    "AgentContext",
    "AgentLoopBase",
    "AgentLoopOutput",
    "AgentRunner",
    "AgentSample",
    "OpenAIAgentLoop",
    "PromptGroup",
    "ReplayBudgetError",
    "Rollouter",
    "SingleTurnAgentLoop",
    "TakenBatch",
    "ToolAgentLoop",
    "ToolCall",
    "TrajectoryGroup",
    "TrajectoryQueue",
    "agent_metrics",
    "close_openai_endpoint",
    "dapo_group_filter",
    "format_tool_call",
    "get_agent_loop",
    "get_tool_parser",
    "load_agent_resources",
    "merge_windows",
    "off_policy_metrics",
    "register_agent_loop",
    "take_metrics",
    "truncate_text",
]
