"""Convert GSM8K-style json/jsonl ({"question", "answer": "... #### N"}) to verl-schema parquet.

  python scripts/convert_gsm8k.py --input gsm8k/train.jsonl --output data/gsm8k/train.parquet \
      --split train
  python scripts/convert_gsm8k.py --input gsm8k/test.jsonl --output /tmp/x.parquet --dry-run

--dry-run converts and validates every row and prints a summary, but writes nothing.
"""
from __future__ import annotations

import argparse
import json
import sys

from jaxrl_llm.data import read_rows, validate_row, write_rows
from jaxrl_llm.data._schema import read_raw_rows
from jaxrl_llm.data.tasks import gsm8k_rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="GSM8K .jsonl or .json file")
    parser.add_argument("--output", required=True, help=".parquet (or .jsonl) file to write")
    parser.add_argument("--split", default="train", help="recorded in extra_info.split")
    parser.add_argument("--dry-run", action="store_true", help="convert and check, write nothing")
    args = parser.parse_args(argv)
    rows = gsm8k_rows(read_raw_rows(args.input), split=args.split, source=args.input)
    for index, row in enumerate(rows):
        validate_row(row, path=args.output, index=index)
    if not args.dry_run:
        write_rows(args.output, rows)
        read_rows(args.output)  # the written file reads back in verl's schema
    print(json.dumps({"input": args.input, "output": args.output, "rows": len(rows),
                      "written": not args.dry_run}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
