//! `strftime_now(format)` for chat templates (transformers defines it; some templates put
//! today's date in the system prompt). UTC, the directives `%d %m %Y %y %b %B %a %A %H %M %S
//! %j %%`; anything else is an error naming it.

use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::{Error, ErrorKind};

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Civil date of a day count since 1970-01-01 (Howard Hinnant's algorithm).
fn civil(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = u32::try_from(doy - (153 * mp + 2) / 5 + 1).unwrap_or(1);
    let m = u32::try_from(if mp < 10 { mp + 3 } else { mp - 9 }).unwrap_or(1);
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

pub fn format(secs: i64, fmt: &str) -> Result<String, Error> {
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (y, m, d) = civil(days);
    let day_of_year = days - days_from_civil(y) + 1;
    let weekday = usize::try_from((days + 3).rem_euclid(7)).unwrap_or(0);
    let month = MONTHS[usize::try_from(m - 1).unwrap_or(0)];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('b') => out.push_str(&month[..3]),
            Some('B') => out.push_str(month),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('H') => out.push_str(&format!("{:02}", rem / 3600)),
            Some('M') => out.push_str(&format!("{:02}", rem / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", rem % 60)),
            Some('j') => out.push_str(&format!("{day_of_year:03}")),
            Some('%') => out.push('%'),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: %{} is not supported", other.unwrap_or(' ')),
                ));
            }
        }
    }
    Ok(out)
}

fn days_from_civil(y: i64) -> i64 {
    // Days from 1970-01-01 to January 1st of `y`.
    let y = y - 1;
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + 306;
    era * 146_097 + doe - 719_468
}

pub fn strftime_now(fmt: &str) -> Result<String, Error> {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(0));
    format(secs, fmt)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_dates_as_python_does() {
        // 2024-07-26 13:05:09 UTC, a Friday, day 208.
        let t = 1_721_999_109;
        assert_eq!(format(t, "%d %b %Y").unwrap(), "26 Jul 2024");
        assert_eq!(
            format(t, "%A %B %j %H:%M:%S %y%%").unwrap(),
            "Friday July 208 13:05:09 24%"
        );
        assert_eq!(format(0, "%Y-%m-%d %a").unwrap(), "1970-01-01 Thu");
        assert!(format(t, "%Q").is_err());
    }
}
