//! The integration tests of this package in one binary: each module below was a test binary of
//! its own, and each linked the whole stack; one link instead of several keeps CI's build short.

mod external_project;
mod forward_cli;
mod quantize_cli;
mod report_html;
mod trained_fixture;
