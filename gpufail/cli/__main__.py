"""`python -m gpufail.cli`: the same as the `gpufail` console script."""

from gpufail.cli import main

main()
