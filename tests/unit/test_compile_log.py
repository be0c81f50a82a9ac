"""The compile progress line: written by the compile phase, read by `trnflow compile`, one type."""

from trnflow.neuron.compile_log import CompileProgress


def test_the_progress_line_reads_back_as_it_was_written_and_in_the_tools_words():
    progress = CompileProgress.counting(done=2, failed=1, locked=1, total=7)
    line = progress.line()
    assert line == ("INFO ||NEURON_CACHE||: Current remaining items are 3, locked are 1, failed are 1, done are 2, "
                    "total is 7")
    log = f"some other output\n{line}\n{CompileProgress.counting(done=7, failed=0, locked=0, total=7).line()}\n"
    assert CompileProgress.each_in(log) == [progress, CompileProgress(remaining=0, locked=0, failed=0, done=7,
                                                                      total=7)]
    assert CompileProgress.each_in("INFO ||NEURON_CACHE||: Compile cache path: /tmp/c") == []
