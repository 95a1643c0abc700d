from .cli import main

if __name__ == "__main__":  # also guards spawned tokenizer workers, which re-import this module
    raise SystemExit(main())
