//! The UTC calendar, for the few places that print a date: chat templates' `strftime_now`
//! (Llama 3.x and Granite write today's date into the system prompt, as transformers and
//! llama.cpp let them) and `toy train`'s run ids. UTC, not the local zone: a server's zone is
//! rarely its user's, and UTC keeps a prompt the same on every machine at one moment.

/// Seconds since the Unix epoch (0 if the clock is before it).
pub fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// Python's `strftime` codes for `seconds` since the Unix epoch, in UTC. Unknown codes stay as
/// written, as glibc's do.
pub fn strftime(format: &str, seconds: i64) -> String {
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
    let days = seconds.div_euclid(86_400);
    let secs = seconds.rem_euclid(86_400);
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    // Howard Hinnant's civil_from_days: the proleptic Gregorian date of a day count.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_march = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_march + 2) / 153;
    let day = doy_march - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    let before = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334][month as usize - 1];
    let yday = before + day + i64::from(leap && month > 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out += &year.to_string(),
            Some('y') => out += &format!("{:02}", year.rem_euclid(100)),
            Some('m') => out += &format!("{month:02}"),
            Some('B') => out += MONTHS[month as usize - 1],
            Some('b') | Some('h') => out += &MONTHS[month as usize - 1][..3],
            Some('d') => out += &format!("{day:02}"),
            Some('e') => out += &format!("{day:>2}"),
            Some('j') => out += &format!("{yday:03}"),
            Some('A') => out += DAYS[weekday],
            Some('a') => out += &DAYS[weekday][..3],
            Some('H') => out += &format!("{hour:02}"),
            Some('I') => out += &format!("{hour12:02}"),
            Some('p') => out += if hour < 12 { "AM" } else { "PM" },
            Some('M') => out += &format!("{minute:02}"),
            Some('S') => out += &format!("{second:02}"),
            Some('F') => out += &format!("{year}-{month:02}-{day:02}"),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_writes_python_codes() {
        // Values from Python: datetime.fromtimestamp(t, timezone.utc).strftime(f).
        let f = "%d %b %Y|%B %d, %Y|%A %a %j %H:%M:%S %I%p %y %e %F %% %Q";
        assert_eq!(
            strftime(f, 1_796_342_400 + 13 * 3600 + 5 * 60 + 9),
            "04 Dec 2026|December 04, 2026|Friday Fri 338 13:05:09 01PM 26  4 2026-12-04 % %Q"
        );
        assert_eq!(
            strftime("%A %d %B %Y %j", 951_782_400),
            "Tuesday 29 February 2000 060"
        );
        assert_eq!(strftime("%Y-%m-%d %a", 0), "1970-01-01 Thu");
        // `toy train`'s run ids.
        assert_eq!(strftime("%Y%m%d-%H%M%S", 1_796_342_409), "20261204-000009");
        assert_eq!(strftime("%Y-%m-%d %H", -1), "1969-12-31 23");
    }
}
