"""The JSON-extraction workload: a passage and a JSON Schema per task; every reply is constrained
to its schema (`exactspec.constraints`) and checked against it afterwards (`jsonschema`).

Extraction is what structured output is mostly used for: the values are copied from the passage
(prompt lookup drafts them) and the keys and punctuation are forced by the schema (the grammar
drafts them), so it is where constrained speculative decoding should gain most.
"""
from __future__ import annotations

import json

from exactspec.bench.humaneval import count_in_range

WORKLOAD = "json"
# A reply's default budget (`exactspec bench --workload json`; it ends at its JSON's end): room
# enough that a reply is cut off, and so not JSON, only where a sampled number never ends (the
# budget's measurement: docs/design.md, "Moved from comments").
MAX_NEW_TOKENS = 320
INSTRUCTION = ("Extract the information from the passage as a JSON object with these keys. "
               "Copy names and values exactly as the passage writes them.")


def _object(properties: dict, required=None) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(required or properties), "additionalProperties": False}


# Strings and arrays are bounded, as an application's schema would bound them: a small model
# can repeat an array item or run on inside a string until its token budget ends.
_S, _I, _N = {"type": "string", "maxLength": 40}, {"type": "integer"}, {"type": "number"}
_STRINGS = {"type": "array", "items": _S, "maxItems": 4}

# The passages, one paragraph a task: its name, a colon, then the text (its lines joined by spaces).
_PASSAGES = """
person: Maria Lopez is a 34-year-old nurse who lives in Valencia, Spain. She has worked at the
Hospital La Fe since 2015 and speaks Spanish, English and Catalan.

order: Order 58213 was placed by Thomas Becker on 12 March 2024: two packs of AA batteries at
4.99 each and one desk lamp at 24.50, shipped to Hamburg by express delivery.

event: The Riverside Jazz Festival takes place on Saturday 14 June at Memorial Park. Gates open
at 4 pm, tickets cost 35 dollars, and the headliner is the Ellen Hart Quartet.

book: "The Silent Harbor" is a mystery novel by Anna Kowalski, published in 2019 by Northwind
Press. It has 312 pages and won the Golden Quill award.

weather: Forecast for Denver on Tuesday: sunny in the morning, thunderstorms after 3 pm, a high
of 29 degrees and a low of 14 degrees, with winds from the west at 20 km/h.

company: Greenleaf Robotics, founded in 2011 by Priya Natarajan and Leo Brandt, is based in
Austin, Texas. The company has 420 employees and builds warehouse robots.

flight: Flight LH 438 from Frankfurt to Chicago departs at 10:25 from gate B44 and arrives at
12:40 local time. The aircraft is an Airbus A350 and the flight is on time.

recipe: Pancakes for four: mix 200 grams of flour, 2 eggs, 300 millilitres of milk and a pinch
of salt, rest the batter for 10 minutes, then fry each pancake for 2 minutes per side.

apartment: For rent: a two-bedroom apartment on Elm Street 17, third floor, 68 square metres,
with a balcony and no elevator. The rent is 1150 euros per month, available from 1 September.

paper: In their 2021 paper "Sparse Attention at Scale", Chen, Okafor and Duval report a 2.3
times speedup on 8 GPUs and release their code under the MIT license.
"""

# Each task's JSON Schema, by name.
_SCHEMAS = {
    "person": _object({"name": _S, "age": _I, "occupation": _S, "city": _S, "country": _S,
                       "languages": _STRINGS}),
    "order": _object({"order_id": _I, "customer": _S, "date": _S, "city": _S, "shipping": _S,
                      "items": {"type": "array", "maxItems": 3,
                                "items": _object({"product": _S, "quantity": _I, "unit_price": _N})}}),
    "event": _object({"event": _S, "day": _S, "date": _S, "venue": _S, "opens": _S,
                      "ticket_price": _N, "headliner": _S}),
    "book": _object({"title": _S, "author": _S, "genre": _S, "year": _I, "publisher": _S,
                     "pages": _I, "awards": _STRINGS}),
    "weather": _object({"city": _S, "day": _S, "morning": _S, "afternoon": _S, "high": _I, "low": _I,
                        "wind_direction": _S, "wind_speed_kmh": _I}),
    "company": _object({"company": _S, "founded": _I, "founders": _STRINGS, "city": _S, "state": _S,
                        "employees": _I, "product": _S}),
    "flight": _object({"flight": _S, "from": _S, "to": _S, "departs": _S, "gate": _S, "arrives": _S,
                       "aircraft": _S, "status": _S}),
    "recipe": _object({"dish": _S, "servings": _I, "rest_minutes": _I, "minutes_per_side": _I,
                       "ingredients": {"type": "array", "maxItems": 5,
                                       "items": _object({"name": _S, "amount": _S})}}),
    "apartment": _object({"address": _S, "bedrooms": _I, "floor": _I, "area_m2": _I, "balcony": {"type": "boolean"},
                          "elevator": {"type": "boolean"}, "rent_eur": _I, "available_from": _S}),
    "paper": _object({"title": _S, "year": _I, "authors": _STRINGS, "speedup": _N, "gpus": _I,
                      "license": _S}),
}


def _tasks(passages: str) -> tuple[tuple[str, str, dict], ...]:
    """(name, passage, schema) of each paragraph of `passages`, in order."""
    tasks = []
    for paragraph in passages.strip().split("\n\n"):
        name, _, passage = " ".join(paragraph.splitlines()).partition(": ")
        tasks.append((name, passage, _SCHEMAS[name]))
    return tuple(tasks)


TASKS: tuple[tuple[str, str, dict], ...] = _tasks(_PASSAGES)  # (name, passage, schema)


def parse_count(text: str, name: str = "--workload") -> int:
    """"json" → every task; "json:N" → the first N (1..len(TASKS))."""
    _, sep, count = str(text).strip().lower().partition(":")
    if not sep:
        return len(TASKS)
    return count_in_range(count, text, name, len(TASKS), "json tasks")


def workload_prompts(text: str) -> list:
    """The BenchPrompts of "json[:N]": kind "json", each with its schema as its constraint."""
    from exactspec.bench.config import BenchPrompt
    from exactspec.constraints import Constraint

    return [BenchPrompt(name, WORKLOAD, f"{INSTRUCTION}\n\nPassage: {passage}\n\nKeys: "
                                        f"{', '.join(schema['properties'])}",
                        constraint=Constraint.json_schema(schema))
            for name, passage, schema in TASKS[: parse_count(text)]]


def is_valid(schema: dict, text: str) -> bool:
    """Whether `text` is JSON valid against `schema` (jsonschema's Draft 2020-12 validator)."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True
