//! llama.cpp's GBNF grammars (`root ::= "yes" | "no"`) rewritten into llguidance's Lark, so a
//! `grammar` written for llama-server works unchanged. A grammar without `::=` is Lark already.
//!
//! What changes: `::=` becomes `:`; `root` becomes `start` and every other rule name becomes a
//! Lark rule name; string escapes become JSON ones; a character class `[…]` and `.` become
//! regexes. Grouping, `|`, `* + ?` and `{m,n}` mean the same in both. Token references are
//! llguidance's own syntax already: `<[128000]>` (a token by id), `<|im_end|>` (a control token
//! by its text); `!<[128000]>` (any token but that one) becomes `<[^128000]>`.

use std::collections::HashMap;

/// `grammar` as Lark: rewritten when it is GBNF, as it is otherwise.
pub fn to_lark(grammar: &str) -> Result<String, String> {
    if !grammar.contains("::=") {
        return Ok(grammar.to_string());
    }
    Converter {
        src: grammar.chars().collect(),
        pos: 0,
        names: HashMap::new(),
    }
    .run()
    .map_err(|e| format!("GBNF: {e}"))
}

struct Converter {
    src: Vec<char>,
    pos: usize,
    names: HashMap<String, String>,
}

impl Converter {
    fn peek(&self) -> Option<char> {
        self.src.get(self.pos).copied()
    }

    fn at(&self, s: &str) -> bool {
        s.chars()
            .enumerate()
            .all(|(i, c)| self.src.get(self.pos + i) == Some(&c))
    }

    fn where_(&self) -> String {
        let line = self.src[..self.pos.min(self.src.len())]
            .iter()
            .filter(|&&c| c == '\n')
            .count();
        format!("line {}", line + 1)
    }

    /// Skip spaces, newlines and `#` comments.
    fn skip(&mut self) {
        while let Some(c) = self.peek() {
            if c.is_whitespace() {
                self.pos += 1;
            } else if c == '#' {
                while self.peek().is_some_and(|c| c != '\n') {
                    self.pos += 1;
                }
            } else {
                break;
            }
        }
    }

    fn name(&mut self) -> Option<String> {
        let start = self.pos;
        while self
            .peek()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            self.pos += 1;
        }
        (self.pos > start).then(|| self.src[start..self.pos].iter().collect())
    }

    /// The Lark name of a GBNF rule: `root` is `start`; a name Lark reads as a rule name stays.
    fn lark_name(&mut self, gbnf: &str) -> String {
        if gbnf == "root" {
            return "start".into();
        }
        let n = self.names.len();
        self.names
            .entry(gbnf.to_string())
            .or_insert_with(|| {
                let lark_ok = gbnf.starts_with(|c: char| c.is_ascii_lowercase())
                    && gbnf.chars().all(|c| {
                        c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_'
                    })
                    && gbnf != "start";
                if lark_ok {
                    gbnf.to_string()
                } else {
                    format!("gbnf{n}")
                }
            })
            .clone()
    }

    /// Whether a rule definition (`name ::=`) starts here.
    fn at_definition(&mut self) -> bool {
        let save = self.pos;
        let found = self.name().is_some() && {
            while self.peek().is_some_and(|c| c == ' ' || c == '\t') {
                self.pos += 1;
            }
            self.at("::=")
        };
        self.pos = save;
        found
    }

    fn run(mut self) -> Result<String, String> {
        let mut out = String::new();
        self.skip();
        while self.peek().is_some() {
            let name = self
                .name()
                .ok_or_else(|| format!("a rule name expected at {}", self.where_()))?;
            self.skip();
            if !self.at("::=") {
                return Err(format!(
                    "`::=` expected after {name:?} at {}",
                    self.where_()
                ));
            }
            self.pos += 3;
            let lark = self.lark_name(&name);
            out.push_str(&lark);
            out.push(':');
            self.body(&mut out)?;
            out.push('\n');
        }
        Ok(out)
    }

    /// A rule's alternatives, up to the next definition, on one line.
    fn body(&mut self, out: &mut String) -> Result<(), String> {
        loop {
            self.skip();
            let Some(c) = self.peek() else { return Ok(()) };
            if self.at_definition() {
                return Ok(());
            }
            out.push(' ');
            match c {
                '"' => {
                    self.pos += 1;
                    let mut text = String::new();
                    loop {
                        match self.peek() {
                            None => {
                                return Err(format!("unterminated string at {}", self.where_()));
                            }
                            Some('"') => {
                                self.pos += 1;
                                break;
                            }
                            Some(_) => text.push(self.char_or_escape()?),
                        }
                    }
                    out.push_str(&json_string(&text));
                }
                '[' => {
                    self.pos += 1;
                    let mut class = String::from("/[");
                    if self.peek() == Some('^') {
                        self.pos += 1;
                        class.push('^');
                    }
                    let mut empty = true;
                    loop {
                        match self.peek() {
                            None => {
                                return Err(format!("unterminated [...] at {}", self.where_()));
                            }
                            Some(']') if !empty => {
                                self.pos += 1;
                                break;
                            }
                            Some(_) => {
                                let lo = self.char_or_escape()?;
                                class.push_str(&regex_char(lo));
                                if self.peek() == Some('-')
                                    && self.src.get(self.pos + 1) != Some(&']')
                                {
                                    self.pos += 1;
                                    let hi = self.char_or_escape()?;
                                    class.push('-');
                                    class.push_str(&regex_char(hi));
                                }
                                empty = false;
                            }
                        }
                    }
                    class.push_str("]/");
                    out.push_str(&class);
                }
                '.' => {
                    self.pos += 1;
                    out.push_str("/(?s:.)/");
                }
                '(' | ')' | '|' | '*' | '+' | '?' => {
                    self.pos += 1;
                    out.push(c);
                }
                '{' => {
                    while let Some(c) = self.peek() {
                        self.pos += 1;
                        if !(c.is_ascii_digit() || c == ',' || c == '{' || c == '}' || c == ' ') {
                            return Err(format!("bad repetition {{m,n}} at {}", self.where_()));
                        }
                        if c != ' ' {
                            out.push(c);
                        }
                        if c == '}' {
                            break;
                        }
                    }
                }
                '<' | '!' => out.push_str(&self.token_ref()?),
                c if c.is_ascii_alphanumeric() || c == '-' || c == '_' => {
                    let name = self.name().unwrap_or_default();
                    let lark = self.lark_name(&name);
                    out.push_str(&lark);
                }
                c => return Err(format!("unexpected {c:?} at {}", self.where_())),
            }
        }
    }

    /// A token reference, `<…>` or `!<…>`, as llguidance writes it.
    fn token_ref(&mut self) -> Result<String, String> {
        let at = self.where_();
        let negated = self.peek() == Some('!');
        if negated {
            self.pos += 1;
        }
        if self.peek() != Some('<') {
            return Err(format!("expected a token reference <…> after ! at {at}"));
        }
        let end = self.src[self.pos..]
            .iter()
            .position(|&c| c == '>')
            .ok_or_else(|| format!("unterminated token reference at {at}"))?;
        let inner: String = self.src[self.pos + 1..self.pos + end].iter().collect();
        self.pos += end + 1;
        if inner.is_empty() || inner.chars().any(|c| c.is_whitespace() || c == '<') {
            return Err(format!("bad token reference <{inner}> at {at}"));
        }
        let id = inner
            .strip_prefix('[')
            .and_then(|i| i.strip_suffix(']'))
            .map(|i| {
                i.parse::<u32>()
                    .map_err(|_| format!("bad token id <{inner}> at {at}"))
            })
            .transpose()?;
        Ok(match (id, negated) {
            (Some(id), false) => format!("<[{id}]>"),
            (Some(id), true) => format!("<[^{id}]>"),
            (None, false) => format!("<{inner}>"),
            (None, true) => {
                return Err(format!(
                    "!<{inner}> (any token but one named by its text) is not supported, at {at}: \
                     write it by id, !<[ID]> (POST /tokenize gives the id)"
                ));
            }
        })
    }

    /// One character of a string or class, escapes decoded (`\n \r \t \\ \" \[ \] \- \xHH
    /// \uHHHH \UHHHHHHHH`).
    fn char_or_escape(&mut self) -> Result<char, String> {
        let c = self.peek().ok_or("unexpected end")?;
        self.pos += 1;
        if c != '\\' {
            return Ok(c);
        }
        let e = self.peek().ok_or("unexpected end after \\")?;
        self.pos += 1;
        let hex = |me: &mut Self, n: usize| -> Result<char, String> {
            let digits: String = me.src.iter().skip(me.pos).take(n).collect();
            me.pos += n;
            u32::from_str_radix(&digits, 16)
                .ok()
                .filter(|_| digits.len() == n)
                .and_then(char::from_u32)
                .ok_or_else(|| format!("bad escape \\{e}{digits} at {}", me.where_()))
        };
        Ok(match e {
            'n' => '\n',
            'r' => '\r',
            't' => '\t',
            'x' => hex(self, 2)?,
            'u' => hex(self, 4)?,
            'U' => hex(self, 8)?,
            '\\' | '"' | '[' | ']' | '-' | '^' => e,
            other => return Err(format!("unknown escape \\{other} at {}", self.where_())),
        })
    }
}

/// A Lark string literal (JSON syntax; control characters and DEL escaped).
fn json_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\u{:04x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// One character inside a regex class, escaped so that no character is special.
fn regex_char(c: char) -> String {
    if c.is_ascii_alphanumeric() {
        c.to_string()
    } else {
        format!("\\x{{{:x}}}", c as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::to_lark;

    #[test]
    fn gbnf_rules_become_lark_rules() {
        let gbnf = r#"
            # a comment
            root   ::= "say: " answer ws-end
            answer ::= ("yes" | "no")
                       [a-z]{2,3} [^"\]]*
            ws-end ::= [ \t\n]? .
            Caps ::= "\x41\u00e9\"" answer+
        "#;
        assert_eq!(
            to_lark(gbnf).unwrap(),
            "start: \"say: \" answer ws-end\n\
             answer: ( \"yes\" | \"no\" ) /[a-z]/ {2,3} /[^\\x{22}\\x{5d}]/ *\n\
             ws-end: /[\\x{20}\\x{9}\\x{a}]/ ? /(?s:.)/\n\
             gbnf2: \"Aé\\\"\" answer +\n"
        );
        // Token references, as llama.cpp writes them.
        assert_eq!(
            to_lark("root ::= <think> (!<[7]>)* <[7]> <|im_end|>").unwrap(),
            "start: <think> ( <[^7]> ) * <[7]> <|im_end|>\n"
        );
        // Lark passes through.
        assert_eq!(to_lark("start: \"a\"").unwrap(), "start: \"a\"");
    }

    #[test]
    fn bad_gbnf_says_where() {
        assert!(
            to_lark("root ::= \"a")
                .unwrap_err()
                .contains("unterminated string")
        );
        assert!(to_lark("root ::= [a").unwrap_err().contains("unterminated"));
        assert!(
            to_lark("root ::= \"\\q\"")
                .unwrap_err()
                .contains("unknown escape")
        );
        assert!(
            to_lark("root ::= <[12x]>")
                .unwrap_err()
                .contains("token id")
        );
        assert!(
            to_lark("root ::= <think")
                .unwrap_err()
                .contains("unterminated")
        );
        assert!(to_lark("root ::= !\"a\"").unwrap_err().contains("after !"));
        assert!(to_lark("root ::= !<think>").unwrap_err().contains("by id"));
        assert!(to_lark("::= \"a\"").unwrap_err().contains("rule name"));
    }
}
