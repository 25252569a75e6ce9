"""Function-calling cases with ground truth, and their scoring (issue 47's accuracy must-show).

A case: `messages` (the user's turn), `tools` (OpenAI's shape: the right tool among others) and
`truth`: the accepted calls, `[{function name: {argument: [accepted values]}}]` (BFCL's shape: an
argument whose list holds "" may be left out). A call is right when its name is the truth's and
every argument it gives is one of the accepted values (strings compared loosely, as BFCL does:
case, spaces and punctuation aside), none is missing and none is extra.

Cases: `own_cases()`, 120 of this project's own (ten tools, twelve requests each, generated from a
fixed seed), and `bfcl_cases(n)`: the first n of BFCL's `simple_python` set, read from the
`bfcl-eval` package's wheel (Apache-2.0; `pip download --no-deps bfcl-eval`, or the package
installed; its dotted function names become
OpenAI-legal names, its schema types JSON Schema's).
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
import zipfile
from pathlib import Path

_STR = {"type": "string"}


def _fn(name: str, description: str, props: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props, "required": required}}}


TOOLS = {
    "get_weather": _fn("get_weather", "Current weather in a city.",
                       {"city": _STR, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city", "unit"]),
    "convert_currency": _fn("convert_currency", "Convert an amount of money between currencies (ISO codes).",
                            {"amount": {"type": "number"}, "from_currency": _STR, "to_currency": _STR},
                            ["amount", "from_currency", "to_currency"]),
    "set_alarm": _fn("set_alarm", "Set an alarm at a time of day (24-hour clock).",
                     {"hour": {"type": "integer"}, "minute": {"type": "integer"}}, ["hour", "minute"]),
    "send_email": _fn("send_email", "Send an email.", {"to": _STR, "subject": _STR}, ["to", "subject"]),
    "search_flights": _fn("search_flights", "Search flights between two cities on a date (YYYY-MM-DD).",
                          {"origin": _STR, "destination": _STR, "date": _STR}, ["origin", "destination", "date"]),
    "calculate_bmi": _fn("calculate_bmi", "Body mass index from weight and height.",
                         {"weight_kg": {"type": "number"}, "height_m": {"type": "number"}}, ["weight_kg", "height_m"]),
    "translate_text": _fn("translate_text", "Translate text into a language.",
                          {"text": _STR, "target_language": _STR}, ["text", "target_language"]),
    "get_stock_price": _fn("get_stock_price", "Latest price of a stock by its ticker symbol.",
                           {"symbol": _STR}, ["symbol"]),
    "compute_tip": _fn("compute_tip", "The tip on a restaurant bill.",
                       {"bill": {"type": "number"}, "percent": {"type": "number"}}, ["bill", "percent"]),
    "create_reminder": _fn("create_reminder", "Create a reminder with a text and a number of minutes from now.",
                           {"text": _STR, "minutes": {"type": "integer"}}, ["text", "minutes"]),
}

CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Denver", "Madrid", "Seoul", "Nairobi", "Toronto", "Lisbon",
          "Hanoi"]
CURRENCIES = ["USD", "EUR", "JPY", "GBP", "CHF", "CAD"]
PEOPLE = ["ana@example.com", "bo@example.org", "chen@example.net", "dev@example.com"]
SUBJECTS = ["Lunch on Friday", "Quarterly report", "Travel plans", "Server outage"]
PHRASES = ["good morning", "where is the station", "thank you very much", "the meeting is at noon"]
LANGUAGES = ["French", "Spanish", "German", "Japanese", "Italian"]
TICKERS = [("Apple", "AAPL"), ("Microsoft", "MSFT"), ("Nvidia", "NVDA"), ("Amazon", "AMZN"), ("Tesla", "TSLA")]
TASKS = ["call mom", "water the plants", "take the laundry out", "stretch", "check the oven"]


def _one(name: str, rnd: random.Random) -> tuple[str, dict]:
    """A request for tool `name` and its accepted arguments."""
    if name == "get_weather":
        city, unit = rnd.choice(CITIES), rnd.choice(["celsius", "fahrenheit"])
        return rnd.choice([f"What's the weather in {city} right now, in {unit}?",
                           f"Tell me the current temperature in {city} in degrees {unit}."]), \
            {"city": [city], "unit": [unit]}
    if name == "convert_currency":
        amount, a, b = rnd.choice([15, 120, 99.5, 2500, 7]), *rnd.sample(CURRENCIES, 2)
        return rnd.choice([f"Convert {amount} {a} to {b}.", f"How much is {amount} {a} in {b}?"]), \
            {"amount": [amount], "from_currency": [a], "to_currency": [b]}
    if name == "set_alarm":
        hour, minute = rnd.randrange(5, 23), rnd.choice([0, 15, 30, 45])
        return rnd.choice([f"Set an alarm for {hour:02d}:{minute:02d}.", f"Wake me up at {hour}:{minute:02d}, please."]), \
            {"hour": [hour], "minute": [minute]}
    if name == "send_email":
        to, subject = rnd.choice(PEOPLE), rnd.choice(SUBJECTS)
        return f'Email {to} with the subject "{subject}".', {"to": [to], "subject": [subject]}
    if name == "search_flights":
        a, b = rnd.sample(CITIES, 2)
        day = rnd.randrange(1, 28)
        return rnd.choice([f"Find flights from {a} to {b} on 2026-03-{day:02d}.",
                           f"I need to fly {a} to {b} on 2026-03-{day:02d}; what is there?"]), \
            {"origin": [a], "destination": [b], "date": [f"2026-03-{day:02d}"]}
    if name == "calculate_bmi":
        w, h = rnd.choice([58, 70, 82.5, 95]), rnd.choice([1.62, 1.75, 1.8, 1.9])
        return f"What is my BMI? I weigh {w} kg and I am {h} m tall.", {"weight_kg": [w], "height_m": [h]}
    if name == "translate_text":
        text, lang = rnd.choice(PHRASES), rnd.choice(LANGUAGES)
        return f'Translate "{text}" into {lang}.', {"text": [text], "target_language": [lang]}
    if name == "get_stock_price":
        company, symbol = rnd.choice(TICKERS)
        return rnd.choice([f"What's {company}'s stock price ({symbol})?", f"Get the latest price for {symbol}."]), \
            {"symbol": [symbol]}
    if name == "compute_tip":
        bill, pct = rnd.choice([42, 87.6, 120, 15.5]), rnd.choice([10, 15, 18, 20])
        return f"How much is a {pct}% tip on a bill of {bill} dollars?", {"bill": [bill], "percent": [pct]}
    text, minutes = rnd.choice(TASKS), rnd.choice([5, 10, 20, 45, 90])
    return f"Remind me to {text} in {minutes} minutes.", {"text": [text], "minutes": [minutes]}


def own_cases(per_tool: int = 12, seed: int = 47) -> list[dict]:
    """Ten tools x `per_tool` requests, each offered with two other tools."""
    rnd, out = random.Random(seed), []
    names = list(TOOLS)
    for name in names:
        for i in range(per_tool):
            question, args = _one(name, rnd)
            others = rnd.sample([n for n in names if n != name], 2)
            tools = [TOOLS[n] for n in sorted([name] + others, key=lambda _: rnd.random())]
            out.append({"id": f"own_{name}_{i}", "messages": [{"role": "user", "content": question}],
                        "tools": tools, "truth": [{name: args}]})
    return out


# -- BFCL -------------------------------------------------------------------------------------------

_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": None}


def _json_schema(node):
    """BFCL's Python-flavoured schema as JSON Schema."""
    if isinstance(node, list):
        return [_json_schema(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "type" and isinstance(value, str):
            if _TYPES.get(value, value) is not None:
                out["type"] = _TYPES.get(value, value)
        elif key in ("optional", "default") and not isinstance(value, (dict, list)):
            continue
        else:
            out[key] = _json_schema(value)
    return out


def openai_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", name)[:64]


def _bfcl_files(wheel: str | None):
    """A reader of BFCL's data files (relative to bfcl_eval/data): from a downloaded wheel, or the
    installed package's folder (found without importing it: its imports pull in its whole harness)."""
    if wheel is not None:
        archive = zipfile.ZipFile(wheel)
        return lambda rel: archive.read(f"bfcl_eval/data/{rel}").decode()
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    data = Path(list(spec.submodule_search_locations)[0]) / "data"
    return lambda rel: (data / rel).read_text()


def bfcl_cases(n: int = 100, wheel: str | None = None, category: str = "simple_python") -> list[dict]:
    """The first n cases of a BFCL category, from `bfcl-eval`'s wheel (`pip download --no-deps
    bfcl-eval`) or its installed package; [] without either."""
    read = _bfcl_files(wheel)
    if read is None:
        return []
    questions = [json.loads(line) for line in read(f"BFCL_v4_{category}.json").splitlines() if line.strip()]
    answers = {a["id"]: a for a in (json.loads(line) for line in
                                    read(f"possible_answer/BFCL_v4_{category}.json").splitlines() if line.strip())}
    out = []
    for q in questions[:n]:
        tools = [{"type": "function", "function": {"name": openai_name(f["name"]), "description": f.get("description", ""),
                                                   "parameters": _json_schema(f["parameters"])}} for f in q["function"]]
        truth = [{openai_name(name): args for name, args in call.items()} for call in answers[q["id"]]["ground_truth"]]
        out.append({"id": q["id"], "messages": q["question"][0], "tools": tools, "truth": truth})
    return out


# -- scoring ----------------------------------------------------------------------------------------


def _loose(value):
    if isinstance(value, str):
        return re.sub(r"[ ,./\-_*^'\"]", "", value).lower()
    if isinstance(value, list):
        return [_loose(v) for v in value]
    if isinstance(value, dict):
        return {k: _loose(v) for k, v in value.items()}
    if isinstance(value, bool):  # not a number: True == 1 in Python
        return ("bool", value)
    if isinstance(value, (int, float)):
        return float(value)
    return value


def call_right(name: str, arguments: str, truth: list[dict]) -> bool:
    """Whether one call (its name and its arguments as JSON text) is an accepted answer."""
    try:
        args = json.loads(arguments)
    except ValueError:
        return False
    if not isinstance(args, dict):
        return False
    for accepted in truth:
        if list(accepted) != [name]:
            continue
        want = accepted[name]
        if set(args) - set(want):
            continue
        if any(key not in args and "" not in values for key, values in want.items()):
            continue
        if all(_loose(args[key]) in [_loose(v) for v in want[key]] for key in args):
            return True
    return False


def case_right(calls: list[tuple[str, str]], truth: list[dict]) -> bool:
    """A single-call case: exactly one call, and it is right."""
    return len(calls) == 1 and call_right(calls[0][0], calls[0][1], truth)
