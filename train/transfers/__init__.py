"""`python -m train.transfers`: what a GPU machine without a network needs to train, in folders
that each fit one transfer (cli.py says how).

common    the transfer's layout (kinds of files, the base's place) and its error
wheels    the wheels the machine lacks, fetched here for its Python and glibc
packing   the files to carry, split into folders of at most a call's room
tree      the repository's code that every call carries, from git
manifest  each folder's table of every file and part, with sha256, and its checks
plan      the calls that carry the folders; `build` writes them
install   there: parts joined and checked, wheels installed, files placed (standard library only)
cli       the command line
"""
