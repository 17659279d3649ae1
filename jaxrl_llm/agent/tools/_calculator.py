"""`calculator`: arithmetic on numbers with + - * / // % ** and parentheses.

The expression is parsed with `ast` and walked over a whitelist of node types; nothing is
ever `eval`-ed, names, calls, attributes and everything else are refused. Exponents, integer
sizes and the expression's length are bounded so no call can run for long or eat memory.
"""
from __future__ import annotations

import ast
import math
import operator
from typing import Any

from jaxrl_llm.agent.tools._base import BaseTool, ToolResponse, check_config_keys
from jaxrl_llm.agent.tools._schema import OpenAIFunctionToolSchema, make_schema

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_REFUSED = {ast.Name: "names are", ast.Call: "function calls are",
            ast.Attribute: "attribute access is", ast.Subscript: "indexing is",
            ast.Lambda: "lambdas are", ast.Compare: "comparisons are",
            ast.BoolOp: "boolean operators are"}
_MAX_DIGITS = 1000


class CalculatorError(ValueError):
    """The expression is not allowed or cannot be computed; the message is for the model."""


def _power(base, exponent, max_exponent: int):
    if abs(exponent) > max_exponent:
        raise CalculatorError(f"exponent {exponent} is too large (limit {max_exponent})")
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if exponent * math.log10(abs(base)) > _MAX_DIGITS:
            raise CalculatorError(f"result would have more than {_MAX_DIGITS} digits")
    result = base ** exponent
    if isinstance(result, complex):
        raise CalculatorError("result is not a real number")
    return result


def _divide(a, b):
    if isinstance(a, int) and isinstance(b, int) and b != 0 and a % b == 0:
        return a // b
    return a / b


def _check_size(value):
    if isinstance(value, int) and value.bit_length() > _MAX_DIGITS * 3.33:
        raise CalculatorError(f"result has more than {_MAX_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is too large")
    return value


def _evaluate(node: ast.AST, max_exponent: int):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand, max_exponent))
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left, max_exponent), _evaluate(node.right, max_exponent)
        if isinstance(node.op, ast.Pow):
            return _check_size(_power(left, right, max_exponent))
        if isinstance(node.op, ast.Div):
            return _check_size(_divide(left, right))
        if type(node.op) in _BINARY:
            return _check_size(_BINARY[type(node.op)](left, right))
        if isinstance(node.op, ast.BitXor):
            raise CalculatorError("operator ^ is not supported; use ** for powers")
    for kind, what in _REFUSED.items():
        if isinstance(node, kind):
            raise CalculatorError(f"{what} not allowed; use numbers and + - * / // % **")
    raise CalculatorError(f"unsupported syntax ({type(node).__name__}); "
                          f"use numbers and + - * / // % ** and parentheses")


def calculate(expression: str, *, max_length: int = 256, max_exponent: int = 1000):
    """The value of `expression` (int or float); CalculatorError with a reason otherwise."""
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError("empty expression")
    if len(expression) > max_length:
        raise CalculatorError(f"expression is too long ({len(expression)} > {max_length} chars)")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as e:
        raise CalculatorError(f"invalid expression: {e.msg if hasattr(e, 'msg') else e}") from None
    try:
        return _evaluate(tree.body, max_exponent)
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except OverflowError:
        raise CalculatorError("result is too large") from None


def format_number(value: int | float) -> str:
    """Ints as ints ("4", not "4.0"); other floats to 12 significant digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.12g}"
    return str(value)


class CalculatorTool(BaseTool):
    """Built-in `calculator`. Config: `max_length` (chars, 256), `max_exponent` (1000)."""

    @classmethod
    def default_tool_schema(cls) -> OpenAIFunctionToolSchema:
        return make_schema(
            "calculator", "Evaluate an arithmetic expression with + - * / // % ** and "
            "parentheses, e.g. (3 + 4) * 2 / 7.",
            {"expression": {"type": "string", "description": "The arithmetic expression."}},
            ["expression"])

    def __init__(self, config: dict[str, Any] | None = None, tool_schema=None):
        super().__init__(config, tool_schema)
        check_config_keys("calculator", self.config, {"max_length", "max_exponent"})
        self.max_length = int(self.config.get("max_length", 256))
        self.max_exponent = int(self.config.get("max_exponent", 1000))

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs
                      ) -> tuple[ToolResponse, float, dict]:
        error = self.validate_arguments(parameters)
        if error:
            return ToolResponse(text=error), 0.0, {"error": "invalid_arguments"}
        try:
            value = calculate(parameters["expression"], max_length=self.max_length,
                              max_exponent=self.max_exponent)
        except CalculatorError as e:
            return ToolResponse(text=f"Error: {e}"), 0.0, {"error": "invalid_expression"}
        return ToolResponse(text=format_number(value)), 0.0, {}
