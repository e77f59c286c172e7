"""The test tiers: which tests wait by design (marked ``slow``, left to ``scripts/test``) and the fast tier's guard.

``scripts/check`` runs ``pytest -m "not engine and not slow and not perf"``: the fast tier, under a minute on a quiet
two-core machine. ``scripts/test`` runs everything. A test is ``slow`` here when most of its time is waiting that it
needs to make its point — a ``python -m proxy.cli`` or ``serve --workers N`` subprocess to start, a timeout or a
keep-alive deadline to run out, a live Prometheus to scrape, a headless browser, a stream's cadence, a rollout's
steps — or when it replays a whole committed GPU run (seconds of CPU each), measured with ``--durations`` and CPU
time (1 s or more on a quiet two-core machine, or a subprocess start-up per case). Each module's unit tests, the
property tests and the quick in-process socket tests stay in the fast tier.

:data:`SLOW` maps a module to the reason (every test in it is slow) or to its slow test functions and their reasons
(every parametrization). A new module lands in the fast tier; a run that leaves ``slow`` out ends by naming the tests
that took longer than :data:`FAST_TEST_BUDGET_S` (:func:`over_budget`, called by tests/conftest.py), so that one
which waits is seen, and listed here.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

#: a fast-tier test over this (its call, on a quiet two-core machine: most take under 0.3 s) is named at the end
FAST_TEST_BUDGET_S = 1.5

_CLI = "a python -m proxy.cli subprocess (its start-up) per case"
_SERVE = "a serve subprocess"
_WORKERS = "serve --workers N: a supervisor and its worker processes"
_TIMEOUT = "waits a timeout or a deadline out by design"
_REPLAY = "replays a whole committed GPU run through the verdict (seconds of CPU per case)"
_ROLLOUT = "drives a rollout through its steps with live traffic"

SLOW: dict[str, str | dict[str, str]] = {
    "tests/system/test_workers.py": _WORKERS,
    "tests/system/test_damage.py": _WORKERS,
    "tests/system/test_monitoring_live.py": "a live Prometheus scraping at its interval",
    "tests/procs/test_leftovers.py": _WORKERS + ", SIGKILLed owners, the shutdown timeout",
    "tests/server/test_access.py": _SERVE + " in front of two fault-engine subprocesses per test",
    "tests/system/test_cli.py": {  # test_version_matches_the_package stays: one start-up, the entry point's smoke test
        "test_every_help_describes_and_gives_examples": _CLI,
        "test_flag_mistakes_are_one_line_and_status_2": _CLI,
        "test_config_mistakes_are_one_line_naming_file_line_and_key": _CLI,
        "test_check_config_lists_every_problem_and_prints_the_schema": _CLI,
        "test_banner_only_once_the_socket_serves_and_one_log_format": _CLI,
        "test_busy_port_is_one_line_and_no_banner": _CLI,
        "test_listen_on_an_engines_address_is_refused": _CLI,
        "test_no_report_command_without_a_shadow": _CLI,
        "test_no_log_mirrors_without_a_comparison_log": _CLI,
        "test_blank_api_keys_from_the_environment_are_refused_at_start": _CLI,
        "test_config_errors_never_print_secrets": _CLI,
        "test_the_shutdown_timeout_cuts_off_a_stream_held_open": _CLI + "; " + _TIMEOUT,
    },
    "tests/system/test_structure.py": {"test_a_command_loads_only_itself": _CLI},
    "tests/core/test_diagnose.py": {"test_a_missing_log_file_and_an_unreachable_engine_exit_2": _CLI},
    "tests/system/test_monitoring_static.py": {"test_kustomize_renders_and_validates": "kustomize and its validators"},
    "tests/system/test_oracle.py": {  # its property tests stay
        "test_the_first_screen_fits_and_says_the_answer_once": _REPLAY,
        "test_the_answer_does_not_depend_on_the_order_of_the_results": _REPLAY,
        "test_the_headline_agrees_with_the_regimes_and_the_traffic": _REPLAY,
        "test_the_27b_join_names_both_fp8_engines_and_its_traffic_one": _REPLAY,
        "test_every_printed_command_parses": _REPLAY,
        "test_the_printed_report_command_runs": _REPLAY,
    },
    "tests/bench/verdict/test_decision.py": {
        "test_the_27b_run_for_a_traffic_profile": _REPLAY,
        "test_the_27b_headline_says_discounted_and_its_next_is_a_command_that_runs": _REPLAY,
        "test_the_h100_27b_run_names_both_fp8_switches_and_weighs_the_traffic_sent_through_the_proxy": _REPLAY,
    },
    "tests/bench/verdict/test_verdict.py": {"test_the_h200_run_replays_as_switch_for_both": _REPLAY},
    "tests/bench/report/test_switchway.py": {
        "test_the_27b_plans_swap_with_the_measured_outage_and_a_config_the_reader_loads": _REPLAY,
    },
    "tests/bench/run/test_secrets.py": {
        "test_a_bench_with_a_url_password_and_launch_keys_writes_and_prints_none_of_them": "a real bench against"
        " engine subprocesses",
    },
    "tests/server/workers/test_guard.py": {
        "test_idle_connections_near_the_fd_limit_leave_a_real_request_served": _SERVE,
        "test_an_oversized_body_is_answered_at_once_then_drained_for_the_keep_alive_timeout": _SERVE + "; " + _TIMEOUT,
        "test_an_idle_kept_alive_connection_is_closed_after_the_keep_alive_timeout": _SERVE + "; " + _TIMEOUT,
    },
    "tests/server/observe/test_inflight.py": {
        "test_a_dead_workers_requests_in_flight_leave_the_proxys_count": _WORKERS,
        "test_serve_workers_records_the_whole_proxys_requests_in_flight": _WORKERS,
    },
    "tests/server/switch/test_rollout.py": {
        "test_two_workers_keep_one_share_and_a_restarted_worker_takes_it_up": _WORKERS,
        "test_a_restarted_proxy_carries_on_at_its_step_and_says_so": _SERVE + " twice",
        "test_a_faster_candidate_reaches_the_whole_route_by_itself": _ROLLOUT,
        "test_a_slower_candidate_rolls_back_by_itself_at_the_first_step_and_says_why": _ROLLOUT,
        "test_a_candidate_killed_mid_rollout_gives_its_share_back": _ROLLOUT,
    },
    "tests/server/record/test_loopwatch.py": {
        "test_serve_freezes_its_start_up_objects_and_shortens_the_gil_switch_interval": _SERVE,
    },
    "tests/server/mirror/test_mirror.py": {
        "test_slow_refusing_and_hanging_shadows_leave_the_primary_alone": _TIMEOUT,
        "test_a_full_shadow_drops_copies_instead_of_queueing": _TIMEOUT + " (the shadow's 3 s)",
    },
    "tests/server/test_passthrough.py": {
        "test_a_pass_through_body_that_trickles_gets_a_408": _TIMEOUT + " (the drain)"
    },
    "tests/system/test_hostile.py": {"test_a_slow_body_gets_a_408": _TIMEOUT + " (the drain)"},
    "tests/procs/test_launch.py": {
        "test_a_server_that_answers_but_never_says_ready_times_out_cleanly": _TIMEOUT,
        "test_a_command_that_never_becomes_ready_times_out_and_leaves_no_process": _TIMEOUT,
        "test_ctrl_c_mid_launch_leaves_no_process": _CLI,
    },
    "tests/bench/run/test_bench_launch.py": {
        "test_a_launch_that_never_becomes_ready_times_out_and_leaves_no_process": _TIMEOUT,
        "test_ctrl_c_mid_launch_leaves_no_process": _CLI,
    },
    "tests/bench/live/test_logrotation.py": {
        "test_200_mirrored_requests_through_rotated_logs_give_200_pairs_from_the_banners_command": _SERVE
        + " and 200 mirrored requests",
    },
    "tests/bench/verdict/test_bursts.py": {
        "test_a_burst_stream_is_flagged_and_its_decode_rate_is_the_engines": "a fault-engine stream at its cadence",
    },
    "tests/bench/report/test_headline.py": {"test_the_answer_is_on_the_first_screen_of_the_html": "headless Chromium"},
}


#: unit tests inside a module listed whole in SLOW: they stay in the fast tier
KEEP_FAST = frozenset(
    {
        "tests/system/test_workers.py::test_default_workers_is_within_one_and_eight",
        "tests/system/test_damage.py::test_the_default_state_path_is_keyed_by_listen_address_and_route",
    }
)


def is_slow(nodeid: str) -> bool:
    """The test (``path::name[params]``) is listed in :data:`SLOW`, itself or its whole module (less KEEP_FAST)."""
    test = nodeid.split("[", 1)[0]
    path, _, name = test.partition("::")
    listed = SLOW.get(path)
    if isinstance(listed, str):
        return test not in KEEP_FAST
    return listed is not None and name.split("::")[-1] in listed


def mark_slow(items: Iterable[pytest.Item]) -> None:
    for item in items:
        if is_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)


def over_budget(durations: dict[str, float]) -> list[str]:
    """Lines naming the tests (nodeid -> call seconds) over :data:`FAST_TEST_BUDGET_S`, slowest first."""
    over = sorted(((s, n) for n, s in durations.items() if s > FAST_TEST_BUDGET_S), reverse=True)
    return [f"{s:5.1f} s  {n}" for s, n in over]
