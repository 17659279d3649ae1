"""MATH scorer (verl's `math` semantics: Hendrycks-style normalisation).

The answer is the content of the last \\boxed{...} (or \\fbox{...}, or "\\boxed x") in the
response; it scores 1.0 iff it equals the ground truth after both are normalised by
`normalize_math_answer` (units, \\left/\\right, dfrac/tfrac, degrees, percent, "x = ", spaces,
\\sqrt3, \\frac12, a/b, 0.5 -> \\frac{1}{2}), else 0.0. No boxed answer: 0.0.
"""
from __future__ import annotations


def last_boxed_only_string(text: str) -> str | None:
    """The last "\\boxed{...}" (braces matched) or "\\boxed x" in `text`, or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    if text.startswith("\\boxed ", start):
        return "\\boxed " + text[start + len("\\boxed "):].split("$")[0]
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start: i + 1]
    return None


def remove_boxed(boxed: str) -> str:
    """"\\boxed{x}" -> "x"; "\\boxed x" -> "x"; "\\fbox{x}" -> "x"."""
    for prefix in ("\\boxed ",):
        if boxed.startswith(prefix):
            return boxed[len(prefix):]
    for prefix in ("\\boxed{", "\\fbox{"):
        if boxed.startswith(prefix) and boxed.endswith("}"):
            return boxed[len(prefix):-1]
    raise ValueError(f"not a boxed expression: {boxed!r}")


def _braced_fracs(s: str) -> str:
    """"\\frac12" -> "\\frac{1}{2}", "\\frac1{2}" -> "\\frac{1}{2}"."""
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part.startswith("{") or len(part) < 2:
            out += part
            continue
        a, b, rest = part[0], part[1], part[2:]
        out += "{" + a + "}" + (b + rest if b == "{" else "{" + b + "}" + rest)
    return out


def _slash_to_frac(s: str) -> str:
    if s.count("/") != 1:
        return s
    a, b = s.split("/")
    if a.isdigit() and b.isdigit() and str(int(a)) == a and str(int(b)) == b:
        return "\\frac{" + a + "}{" + b + "}"
    return s


def _braced_sqrt(s: str) -> str:
    parts = s.split("\\sqrt")
    out = parts[0]
    for part in parts[1:]:
        if part and part[0] != "{":
            out += "\\sqrt{" + part[0] + "}" + part[1:]
        else:
            out += "\\sqrt" + part
    return out


def normalize_math_answer(s: str) -> str:
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"),
                     ("dfrac", "frac"), ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""),
                     ("^\\circ", ""), ("\\$", "")):
        s = s.replace(old, new)
    if "\\text{ " in s:  # trailing units, e.g. "5 \\text{ cm}"
        s = s.split("\\text{ ")[0]
    s = s.replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "x = 5" -> "5"
        s = sides[1]
    s = _braced_sqrt(s).replace(" ", "")
    s = _braced_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_to_frac(s)


def math_equal(answer: str | None, ground_truth: str | None) -> bool:
    if answer is None or ground_truth is None:
        return answer is None and ground_truth is None
    try:
        return normalize_math_answer(answer) == normalize_math_answer(ground_truth)
    except Exception:  # noqa: BLE001 - odd strings fall back to a raw comparison
        return answer == ground_truth


def math_score(solution_str: str, ground_truth, extra_info=None) -> float:
    boxed = last_boxed_only_string(solution_str)
    if boxed is None:
        return 0.0
    try:
        answer = remove_boxed(boxed)
    except ValueError:
        return 0.0
    return 1.0 if math_equal(answer, str(ground_truth)) else 0.0
