"""Reference solutions to the graded exercises, one module per chapter (``solutions/ch01.py`` ...).

Each function has the exact name the notebook's exercise cell uses and is self-contained (imports inside
its body), because answers are shipped to the ranks as source code.
"""
