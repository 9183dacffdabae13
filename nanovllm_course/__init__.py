"""Course support: check helpers for the chapter notebooks and the release tool.

Students never edit this package. Each chapter NN has a module `nanovllm_course.chNN` with its
`check_*` functions; `common` holds what they share; `python -m nanovllm_course release` writes the
student notebooks in chapters/ from the complete ones in solutions/.
"""
