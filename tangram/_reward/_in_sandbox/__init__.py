"""The program that runs *inside* the sandbox: never run in tangram's own process.

:mod:`.._grade` joins these modules' sources (:mod:`._harness`, :mod:`._checks`,
:mod:`._wire`, :mod:`._kept`, :mod:`._fork`, in that order) into one program and runs it with the
sandbox's interpreter, so each imports nothing but the standard library and, but the
first, has no ``from __future__`` import. The host imports them too: to count a label's
tests (:mod:`._checks`) and to test the wire format (:mod:`._wire`).
"""
