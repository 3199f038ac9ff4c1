"""The README's main demo (the code lives in ``compile_rng.demo`` so that
``python -m compile_rng demo`` runs it too)."""

from compile_rng.demo import main

if __name__ == "__main__":
    main()
