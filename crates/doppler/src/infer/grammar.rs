//! Output that parses: JSON (OpenAI's `json_object`: one object), or JSON that follows a
//! JSON Schema (`json_schema`), enforced while sampling by masking the tokens that could
//! not continue it ([`JsonConstraint`], a [`TokenConstraint`]).
//!
//! The schema is compiled into a small graph of nodes; the text so far is held as the
//! set of parser stacks it may be in (more than one only where the schema allows
//! alternatives, e.g. `anyOf`), fed byte by byte. Which tokens may come next is found by
//! walking a trie of the vocabulary's bytes ([`TokenTrie`]) with those stacks, so that
//! tokens sharing a prefix share the work. A stop token is allowed exactly when the value
//! is complete, and then nothing else is: the answer is one JSON value, nothing after it.
//!
//! Schemas: `type` (object, array, string, number, integer, boolean, null, or a list of
//! them), `properties` + `required` (keys come in the schema's order; optional ones may be
//! left out), `additionalProperties` (an object without `properties`: any keys, with
//! values of that schema, or none when false), `items`, `minItems`, `maxItems`, `enum`,
//! `const`, `anyOf` / `oneOf` (alternatives that can be told apart), single-entry
//! `allOf`, `minLength`, `maxLength`, `$ref` into `$defs` / `definitions` (recursion
//! allowed), `nullable`; annotations (`title`, `description`, `default`, `examples`,
//! `format`, ...) are accepted and not enforced. Anything else (`pattern`, `minimum`,
//! `uniqueItems`, ...) is refused by name: [`Grammar::from_schema`] says which.
//!
//! Whitespace between tokens of JSON as llama.cpp's JSON grammar allows it: none, one
//! space, or a newline and up to [`MAX_INDENT`] spaces or tabs (a model cannot spin in
//! blanks), none before or after the value; strings hold valid UTF-8 and no `\u` escapes
//! of surrogates (which strict parsers refuse).

use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::Value;

use super::sample::TokenConstraint;
use super::tokenizer::Tokenizer;

/// Most spaces or tabs after a newline between JSON tokens.
pub const MAX_INDENT: u8 = 20;
/// Most alternatives one value may start as (anyOf / oneOf / $ref flattened), and most
/// values of one enum.
pub const MAX_ALTERNATIVES: usize = 256;
/// Deepest nesting of objects and arrays.
pub const MAX_DEPTH: usize = 64;
/// Most parser stacks followed at once (alternatives beyond are dropped).
const MAX_STATES: usize = 256;

type Id = u32;
const NONE: u32 = u32::MAX;

#[derive(Debug)]
enum Node {
    /// Filled in when a `$ref`'s target has been compiled.
    Pending,
    Object {
        /// Keys as JSON text (quotes included), their value nodes, whether required.
        props: Vec<(Vec<u8>, Id, bool)>,
        /// Without properties: other keys' value node (NONE: no other keys).
        extra: Id,
    },
    Array {
        items: Id,
        min: u32,
        max: u32,
    },
    Str {
        min: u32,
        max: u32,
    },
    Num {
        integer: bool,
    },
    /// Exact texts (true, false, null, enum and const values as compact JSON).
    Lits(Vec<Vec<u8>>),
    AnyOf(Vec<Id>),
}

/// A compiled constraint: which JSON texts are allowed.
#[derive(Debug)]
pub struct Grammar {
    nodes: Vec<Node>,
    root: Id,
}

// Nodes every grammar starts with.
const ANY: Id = 0;
const ANY_OBJECT: Id = 1;
const ANY_ARRAY: Id = 2;
const ANY_STRING: Id = 3;
const NUMBER: Id = 4;
const INTEGER: Id = 5;
const BOOLEAN: Id = 6;
const NULL: Id = 7;

impl Grammar {
    fn base() -> Grammar {
        let lit = |s: &[&str]| Node::Lits(s.iter().map(|t| t.as_bytes().to_vec()).collect());
        Grammar {
            nodes: vec![
                Node::AnyOf(vec![
                    ANY_OBJECT, ANY_ARRAY, ANY_STRING, NUMBER, BOOLEAN, NULL,
                ]),
                Node::Object {
                    props: Vec::new(),
                    extra: ANY,
                },
                Node::Array {
                    items: ANY,
                    min: 0,
                    max: u32::MAX,
                },
                Node::Str {
                    min: 0,
                    max: u32::MAX,
                },
                Node::Num { integer: false },
                Node::Num { integer: true },
                lit(&["true", "false"]),
                lit(&["null"]),
            ],
            root: ANY,
        }
    }

    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    pub fn json_object() -> Grammar {
        Grammar {
            root: ANY_OBJECT,
            ..Grammar::base()
        }
    }

    /// Any JSON value.
    pub fn json_value() -> Grammar {
        Grammar::base()
    }

    /// JSON that follows `schema`; an error names what the grammar cannot express.
    pub fn from_schema(schema: &Value) -> Result<Grammar, String> {
        let mut g = Grammar::base();
        let mut b = Builder {
            doc: schema,
            refs: BTreeMap::new(),
            depth: 0,
        };
        g.root = b.compile(&mut g.nodes, schema, "schema")?;
        g.flatten()?;
        Ok(g)
    }

    /// Every anyOf (and `$ref`) node replaced by the plain alternatives it stands for,
    /// each once, found without recursion: starting a value then never walks nested
    /// alternatives (a schema of `$ref`s doubling at each level cannot cost 2^n, a chain
    /// of 100,000 cannot overflow the stack). Refuses alternatives that lead back to
    /// themselves before any text ($ref cycles with no object or array between: they
    /// could never start a value) and more than [`MAX_ALTERNATIVES`] of them.
    fn flatten(&mut self) -> Result<(), String> {
        let n = self.nodes.len();
        let is_any = |nodes: &[Node], i: usize| matches!(nodes[i], Node::AnyOf(_));
        // 0 unseen, 1 on the path, 2 done.
        let mut mark = vec![0u8; n];
        let mut leaves: Vec<Option<Vec<Id>>> = vec![None; n];
        for root in 0..n {
            if mark[root] != 0 || !is_any(&self.nodes, root) {
                continue;
            }
            mark[root] = 1;
            let mut stack: Vec<(usize, usize)> = vec![(root, 0)];
            while let Some(top) = stack.last_mut() {
                let (id, next) = (top.0, top.1);
                let Node::AnyOf(alts) = &self.nodes[id] else {
                    unreachable!("only anyOf nodes are stacked")
                };
                if next < alts.len() {
                    top.1 += 1;
                    let c = alts[next] as usize;
                    if is_any(&self.nodes, c) {
                        match mark[c] {
                            1 => {
                                return Err("schema: a $ref leads back to itself with no object or array in between".into());
                            }
                            0 => {
                                mark[c] = 1;
                                stack.push((c, 0));
                            }
                            _ => {}
                        }
                    }
                    continue;
                }
                let mut out: Vec<Id> = Vec::new();
                for &c in alts {
                    let own = [c];
                    let add: &[Id] = match is_any(&self.nodes, c as usize) {
                        true => leaves[c as usize].as_deref().unwrap_or(&[]),
                        false => &own,
                    };
                    for &l in add {
                        if !out.contains(&l) {
                            out.push(l);
                        }
                    }
                    if out.len() > MAX_ALTERNATIVES {
                        return Err(format!(
                            "schema: more than {MAX_ALTERNATIVES} alternatives (anyOf, $ref) for one value"
                        ));
                    }
                }
                leaves[id] = Some(out);
                mark[id] = 2;
                stack.pop();
            }
        }
        for (id, l) in leaves.into_iter().enumerate() {
            if let Some(l) = l {
                self.nodes[id] = Node::AnyOf(l);
            }
        }
        Ok(())
    }

    fn push(nodes: &mut Vec<Node>, n: Node) -> Id {
        nodes.push(n);
        (nodes.len() - 1) as Id
    }
}

struct Builder<'a> {
    doc: &'a Value,
    refs: BTreeMap<String, Id>,
    /// Schemas being compiled, one inside the other (bounded: [`MAX_SCHEMA_DEPTH`]).
    depth: usize,
}

/// Deepest nesting of schemas (through `$ref`s too) a grammar is compiled from.
pub const MAX_SCHEMA_DEPTH: usize = 64;

const ANNOTATIONS: &[&str] = &[
    "title",
    "description",
    "default",
    "examples",
    "format",
    "$schema",
    "$id",
    "$comment",
    "deprecated",
    "readOnly",
    "writeOnly",
    "$defs",
    "definitions",
    "strict",
];

impl Builder<'_> {
    fn compile(&mut self, nodes: &mut Vec<Node>, s: &Value, at: &str) -> Result<Id, String> {
        if self.depth >= MAX_SCHEMA_DEPTH {
            return Err(format!(
                "{at}: schemas nested deeper than {MAX_SCHEMA_DEPTH} (through $ref too)"
            ));
        }
        self.depth += 1;
        let r = self.compile_at(nodes, s, at);
        self.depth -= 1;
        r
    }

    fn compile_at(&mut self, nodes: &mut Vec<Node>, s: &Value, at: &str) -> Result<Id, String> {
        let obj = match s {
            Value::Bool(true) => return Ok(ANY),
            Value::Object(o) => o,
            _ => return Err(format!("{at}: a schema must be an object (or true)")),
        };
        for k in obj.keys() {
            let known = ANNOTATIONS.contains(&k.as_str())
                || [
                    "type",
                    "properties",
                    "required",
                    "additionalProperties",
                    "items",
                    "minItems",
                    "maxItems",
                    "enum",
                    "const",
                    "anyOf",
                    "oneOf",
                    "allOf",
                    "minLength",
                    "maxLength",
                    "$ref",
                    "nullable",
                ]
                .contains(&k.as_str());
            if !known {
                return Err(format!("{at}: `{k}` is not supported by the grammar"));
            }
        }
        if let Some(r) = obj.get("$ref") {
            if obj.len() > 1
                && obj
                    .keys()
                    .any(|k| k != "$ref" && !ANNOTATIONS.contains(&k.as_str()))
            {
                return Err(format!(
                    "{at}: `$ref` beside other keywords is not supported"
                ));
            }
            let r = r.as_str().ok_or(format!("{at}.$ref: must be a string"))?;
            return self.reference(nodes, r, at);
        }
        let nullable = obj.get("nullable").and_then(Value::as_bool) == Some(true);
        let id = self.compile_plain(nodes, obj, at)?;
        Ok(match nullable {
            true => Grammar::push(nodes, Node::AnyOf(vec![id, NULL])),
            false => id,
        })
    }

    fn reference(&mut self, nodes: &mut Vec<Node>, r: &str, at: &str) -> Result<Id, String> {
        if r == "#" {
            return match self.refs.get("#") {
                Some(&id) => Ok(id),
                None => {
                    let id = Grammar::push(nodes, Node::Pending);
                    self.refs.insert("#".into(), id);
                    let doc = self.doc;
                    let body = self.compile(nodes, doc, "#")?;
                    nodes[id as usize] = Node::AnyOf(vec![body]);
                    Ok(id)
                }
            };
        }
        let name = r
            .strip_prefix("#/$defs/")
            .map(|n| ("$defs", n))
            .or_else(|| r.strip_prefix("#/definitions/").map(|n| ("definitions", n)));
        let Some((section, name)) = name else {
            return Err(format!(
                "{at}.$ref: `{r}` is not supported (only #/$defs/NAME, #/definitions/NAME, #)"
            ));
        };
        if let Some(&id) = self.refs.get(r) {
            return Ok(id);
        }
        let target = self
            .doc
            .get(section)
            .and_then(|d| d.get(name))
            .ok_or(format!("{at}.$ref: `{r}` is not defined"))?;
        let id = Grammar::push(nodes, Node::Pending);
        self.refs.insert(r.to_string(), id);
        let body = self.compile(nodes, target, r)?;
        nodes[id as usize] = Node::AnyOf(vec![body]);
        Ok(id)
    }

    fn compile_plain(
        &mut self,
        nodes: &mut Vec<Node>,
        obj: &serde_json::Map<String, Value>,
        at: &str,
    ) -> Result<Id, String> {
        if let Some(c) = obj.get("const") {
            return Ok(Grammar::push(nodes, Node::Lits(vec![compact(c)])));
        }
        if let Some(e) = obj.get("enum") {
            let vals = e
                .as_array()
                .filter(|a| !a.is_empty())
                .ok_or(format!("{at}.enum: must be a non-empty list"))?;
            if vals.len() > MAX_ALTERNATIVES {
                return Err(format!("{at}.enum: more than {MAX_ALTERNATIVES} values"));
            }
            return Ok(Grammar::push(
                nodes,
                Node::Lits(vals.iter().map(compact).collect()),
            ));
        }
        for key in ["anyOf", "oneOf", "allOf"] {
            if let Some(list) = obj.get(key) {
                let list = list
                    .as_array()
                    .filter(|a| !a.is_empty())
                    .ok_or(format!("{at}.{key}: must be a non-empty list"))?;
                if key == "allOf" && list.len() > 1 {
                    return Err(format!("{at}.allOf: more than one schema is not supported"));
                }
                let mut ids = Vec::new();
                for (i, s) in list.iter().enumerate() {
                    ids.push(self.compile(nodes, s, &format!("{at}.{key}[{i}]"))?);
                }
                return Ok(Grammar::push(nodes, Node::AnyOf(ids)));
            }
        }
        let types: Vec<String> = match obj.get("type") {
            None => {
                // No type: what the other keywords say, else anything.
                if obj.contains_key("properties") || obj.contains_key("additionalProperties") {
                    vec!["object".into()]
                } else if obj.contains_key("items") {
                    vec!["array".into()]
                } else {
                    return Ok(ANY);
                }
            }
            Some(Value::String(t)) => vec![t.clone()],
            Some(Value::Array(a)) => a
                .iter()
                .map(|t| t.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .ok_or(format!("{at}.type: a list of type names"))?,
            Some(_) => return Err(format!("{at}.type: a type name or a list of them")),
        };
        let mut ids = Vec::new();
        for t in &types {
            ids.push(match t.as_str() {
                "object" => self.object(nodes, obj, at)?,
                "array" => self.array(nodes, obj, at)?,
                "string" => {
                    let (min, max) = (
                        count(obj, "minLength", at)?.unwrap_or(0),
                        count(obj, "maxLength", at)?,
                    );
                    match (min, max) {
                        (0, None) => ANY_STRING,
                        (min, max) => {
                            let max = max.unwrap_or(u32::MAX);
                            if min > max {
                                return Err(format!("{at}: minLength {min} > maxLength {max}"));
                            }
                            Grammar::push(nodes, Node::Str { min, max })
                        }
                    }
                }
                "number" => NUMBER,
                "integer" => INTEGER,
                "boolean" => BOOLEAN,
                "null" => NULL,
                other => return Err(format!("{at}.type: `{other}` is not a JSON Schema type")),
            });
        }
        Ok(match ids.len() {
            1 => ids[0],
            _ => Grammar::push(nodes, Node::AnyOf(ids)),
        })
    }

    fn object(
        &mut self,
        nodes: &mut Vec<Node>,
        obj: &serde_json::Map<String, Value>,
        at: &str,
    ) -> Result<Id, String> {
        let required: Vec<&str> = match obj.get("required") {
            None => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(Value::as_str)
                .collect::<Option<_>>()
                .ok_or(format!("{at}.required: a list of property names"))?,
            Some(_) => return Err(format!("{at}.required: a list of property names")),
        };
        let mut props = Vec::new();
        if let Some(p) = obj.get("properties") {
            let p = p
                .as_object()
                .ok_or(format!("{at}.properties: an object of schemas"))?;
            for (name, s) in p {
                let id = self.compile(nodes, s, &format!("{at}.properties.{name}"))?;
                props.push((
                    compact(&Value::String(name.clone())),
                    id,
                    required.contains(&name.as_str()),
                ));
            }
        }
        if let Some(r) = required.iter().find(|r| {
            !props
                .iter()
                .any(|p| p.0 == compact(&Value::String(r.to_string())))
        }) {
            if !props.is_empty() || obj.get("additionalProperties") == Some(&Value::Bool(false)) {
                return Err(format!("{at}.required: `{r}` is not among the properties"));
            }
            return Err(format!(
                "{at}.required: `{r}` without properties is not supported (list it in properties)"
            ));
        }
        let extra = match (props.is_empty(), obj.get("additionalProperties")) {
            (false, _) => NONE,
            (true, None | Some(Value::Bool(true))) => ANY,
            (true, Some(Value::Bool(false))) => NONE,
            (true, Some(s)) => self.compile(nodes, s, &format!("{at}.additionalProperties"))?,
        };
        Ok(Grammar::push(nodes, Node::Object { props, extra }))
    }

    fn array(
        &mut self,
        nodes: &mut Vec<Node>,
        obj: &serde_json::Map<String, Value>,
        at: &str,
    ) -> Result<Id, String> {
        let items = match obj.get("items") {
            None => ANY,
            Some(s) => self.compile(nodes, s, &format!("{at}.items"))?,
        };
        let n = |k: &str| count(obj, k, at);
        let (min, max) = (
            n("minItems")?.unwrap_or(0),
            n("maxItems")?.unwrap_or(u32::MAX),
        );
        if min > max {
            return Err(format!("{at}: minItems {min} > maxItems {max}"));
        }
        Ok(Grammar::push(nodes, Node::Array { items, min, max }))
    }
}

/// Keyword `k` of a schema as a count (minLength, maxItems, ...): None when absent.
fn count(obj: &serde_json::Map<String, Value>, k: &str, at: &str) -> Result<Option<u32>, String> {
    obj.get(k)
        .map(|v| {
            v.as_u64()
                .map(|n| n.min(u32::MAX as u64 - 1) as u32)
                .ok_or(format!("{at}.{k}: a whole number >= 0"))
        })
        .transpose()
}

fn compact(v: &Value) -> Vec<u8> {
    serde_json::to_vec(v).unwrap_or_default()
}

// ---- the parser ----

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum ObjSt {
    /// After `{`: a key or `}`.
    Open,
    InKey,
    Colon,
    InValue,
    /// After a value: `,` or `}`.
    After,
    /// After `,`: a key.
    NeedKey,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum ArrSt {
    Open,
    InValue,
    After,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum StrSt {
    Plain,
    Escape,
    /// `\u` and this many hex digits to come; whether the first was d or D.
    Hex(u8, bool),
    /// This many UTF-8 continuation bytes to come; the next one's range.
    Utf8(u8, u8, u8),
}

/// Number states: where the text is in -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum NumSt {
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    E,
    ESign,
    Exp,
}

impl NumSt {
    fn can_end(self) -> bool {
        matches!(self, NumSt::Zero | NumSt::Int | NumSt::Frac | NumSt::Exp)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Frame {
    /// A value of the node is to come (whitespace first allowed).
    Value(Id),
    Lit {
        node: Id,
        alt: u32,
        pos: u32,
    },
    Str {
        node: Id,
        st: StrSt,
        len: u32,
    },
    Num {
        integer: bool,
        st: NumSt,
    },
    Obj {
        node: Id,
        st: ObjSt,
        next: u32,
        cur: u32,
    },
    Key {
        node: Id,
        prop: u32,
        pos: u32,
    },
    Arr {
        node: Id,
        st: ArrSt,
        count: u32,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct State {
    frames: Vec<Frame>,
    /// Whitespace since the last JSON token: 0 none, 1 a space, 2 + n a newline and n
    /// spaces or tabs.
    ws: u8,
}

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\n' | b'\t' | b'\r')
}

impl Grammar {
    fn start(&self) -> Vec<State> {
        vec![State {
            frames: vec![Frame::Value(self.root)],
            ws: 0,
        }]
    }

    /// Whether `s` holds a whole value (nothing more is needed).
    fn complete(&self, s: &State) -> bool {
        match s.frames.as_slice() {
            [] => true,
            [Frame::Num { st, .. }] => st.can_end(),
            _ => false,
        }
    }

    fn depth(s: &State) -> usize {
        s.frames
            .iter()
            .filter(|f| matches!(f, Frame::Obj { .. } | Frame::Arr { .. }))
            .count()
    }

    /// Whitespace byte `b` where JSON allows it: a space, or a newline and an indent.
    fn space(mut s: State, b: u8, out: &mut Vec<State>) {
        s.ws = match (s.ws, b) {
            (0, b' ') => 1,
            (0, b'\n') => 2,
            (w, b' ' | b'\t') if (2..2 + MAX_INDENT).contains(&w) => w + 1,
            _ => return,
        };
        out.push(s);
    }

    /// The value on top of `s` is complete: pop it and tell its parent.
    fn finish(&self, mut s: State) -> State {
        s.frames.pop();
        match s.frames.last_mut() {
            Some(Frame::Obj { st, .. }) => {
                *st = match *st {
                    ObjSt::InKey => ObjSt::Colon,
                    _ => ObjSt::After,
                }
            }
            Some(Frame::Arr { st, count, .. }) => {
                *st = ArrSt::After;
                *count += 1;
            }
            _ => {}
        }
        s
    }

    /// Every state `s` can be in after byte `b`.
    fn feed(&self, mut s: State, b: u8, out: &mut Vec<State>) {
        let Some(&top) = s.frames.last() else {
            return; // nothing after a whole value
        };
        let ws = is_ws(b);
        if !ws {
            s.ws = 0;
        }
        match top {
            Frame::Value(node) => {
                if ws {
                    // None before the whole value.
                    if s.frames.len() > 1 {
                        Self::space(s, b, out);
                    }
                    return;
                }
                s.frames.pop();
                self.start_value(node, s, b, out);
            }
            Frame::Lit { node, alt, pos } => {
                let Node::Lits(alts) = &self.nodes[node as usize] else {
                    return;
                };
                let text = &alts[alt as usize];
                if text.get(pos as usize) != Some(&b) {
                    return;
                }
                if pos as usize + 1 == text.len() {
                    out.push(self.finish(s));
                } else {
                    *s.frames.last_mut().unwrap() = Frame::Lit {
                        node,
                        alt,
                        pos: pos + 1,
                    };
                    out.push(s);
                }
            }
            Frame::Str { node, st, len } => {
                let (min, max) = match &self.nodes[node as usize] {
                    Node::Str { min, max } => (*min, *max),
                    _ => (0, u32::MAX),
                };
                let (st2, counted) = match st {
                    StrSt::Plain => match b {
                        b'"' => {
                            if len >= min {
                                out.push(self.finish(s));
                            }
                            return;
                        }
                        b'\\' => (StrSt::Escape, false),
                        0..=0x1f => return,
                        0x20..=0x7f => (StrSt::Plain, true),
                        0xc2..=0xdf => (StrSt::Utf8(1, 0x80, 0xbf), true),
                        0xe0 => (StrSt::Utf8(2, 0xa0, 0xbf), true),
                        0xed => (StrSt::Utf8(2, 0x80, 0x9f), true),
                        0xe1..=0xef => (StrSt::Utf8(2, 0x80, 0xbf), true),
                        0xf0 => (StrSt::Utf8(3, 0x90, 0xbf), true),
                        0xf4 => (StrSt::Utf8(3, 0x80, 0x8f), true),
                        0xf1..=0xf3 => (StrSt::Utf8(3, 0x80, 0xbf), true),
                        _ => return,
                    },
                    StrSt::Escape => match b {
                        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => {
                            (StrSt::Plain, true)
                        }
                        b'u' => (StrSt::Hex(4, false), true),
                        _ => return,
                    },
                    StrSt::Hex(k, d) => {
                        if !b.is_ascii_hexdigit() {
                            return;
                        }
                        // No surrogates (\uD800..\uDFFF): strict parsers refuse lone ones.
                        if k == 3
                            && d
                            && matches!(b.to_ascii_lowercase(), b'8'..=b'9' | b'a'..=b'f')
                        {
                            return;
                        }
                        match k {
                            1 => (StrSt::Plain, false),
                            _ => (StrSt::Hex(k - 1, k == 4 && matches!(b, b'd' | b'D')), false),
                        }
                    }
                    StrSt::Utf8(k, lo, hi) => {
                        if !(lo..=hi).contains(&b) {
                            return;
                        }
                        match k {
                            1 => (StrSt::Plain, false),
                            _ => (StrSt::Utf8(k - 1, 0x80, 0xbf), false),
                        }
                    }
                };
                let len = len + counted as u32;
                if len > max {
                    return;
                }
                *s.frames.last_mut().unwrap() = Frame::Str { node, st: st2, len };
                out.push(s);
            }
            Frame::Num { integer, st } => {
                let digit = b.is_ascii_digit();
                let next = match (st, b) {
                    (NumSt::Minus, b'0') => Some(NumSt::Zero),
                    (NumSt::Minus, _) if digit => Some(NumSt::Int),
                    (NumSt::Int, _) if digit => Some(NumSt::Int),
                    (NumSt::Zero | NumSt::Int, b'.') if !integer => Some(NumSt::Dot),
                    (NumSt::Zero | NumSt::Int | NumSt::Frac, b'e' | b'E') if !integer => {
                        Some(NumSt::E)
                    }
                    (NumSt::Dot | NumSt::Frac, _) if digit => Some(NumSt::Frac),
                    (NumSt::E, b'+' | b'-') => Some(NumSt::ESign),
                    (NumSt::E | NumSt::ESign | NumSt::Exp, _) if digit => Some(NumSt::Exp),
                    _ => None,
                };
                match next {
                    Some(st) => {
                        *s.frames.last_mut().unwrap() = Frame::Num { integer, st };
                        out.push(s);
                    }
                    // The number ends here; the byte goes to what holds it.
                    None if st.can_end() => {
                        let s = self.finish(s);
                        self.feed(s, b, out);
                    }
                    None => {}
                }
            }
            Frame::Key { node, prop, pos } => {
                let Node::Object { props, .. } = &self.nodes[node as usize] else {
                    return;
                };
                let text = &props[prop as usize].0;
                if text.get(pos as usize) != Some(&b) {
                    return;
                }
                if pos as usize + 1 < text.len() {
                    *s.frames.last_mut().unwrap() = Frame::Key {
                        node,
                        prop,
                        pos: pos + 1,
                    };
                    return out.push(s);
                }
                s.frames.pop();
                if let Some(Frame::Obj { st, next, cur, .. }) = s.frames.last_mut() {
                    *st = ObjSt::Colon;
                    *cur = prop;
                    *next = prop + 1;
                }
                out.push(s);
            }
            Frame::Obj {
                node,
                st,
                next,
                cur,
            } => {
                let Node::Object { props, extra } = &self.nodes[node as usize] else {
                    return;
                };
                let (props, extra) = (props, *extra);
                // No required property at or after `next` is left out.
                let may_close = !props[(next as usize).min(props.len())..]
                    .iter()
                    .any(|p| p.2);
                let set = |s: &mut State, st: ObjSt| {
                    *s.frames.last_mut().unwrap() = Frame::Obj {
                        node,
                        st,
                        next,
                        cur,
                    };
                };
                match st {
                    ObjSt::Open | ObjSt::NeedKey => {
                        if ws {
                            return Self::space(s, b, out);
                        }
                        if b == b'}' && st == ObjSt::Open && may_close {
                            return out.push(self.finish(s));
                        }
                        if b != b'"' {
                            return;
                        }
                        if props.is_empty() {
                            if extra == NONE {
                                return;
                            }
                            set(&mut s, ObjSt::InKey);
                            s.frames.push(Frame::Str {
                                node: ANY_STRING,
                                st: StrSt::Plain,
                                len: 0,
                            });
                            return out.push(s);
                        }
                        // Each property that may come next: later ones only past optional ones.
                        set(&mut s, ObjSt::InKey);
                        for (i, p) in props.iter().enumerate().skip(next as usize) {
                            let mut t = s.clone();
                            t.frames.push(Frame::Key {
                                node,
                                prop: i as u32,
                                pos: 1,
                            });
                            out.push(t);
                            if p.2 {
                                break;
                            }
                        }
                    }
                    ObjSt::Colon => {
                        if ws {
                            return Self::space(s, b, out);
                        }
                        if b != b':' {
                            return;
                        }
                        let value = match cur {
                            NONE => extra,
                            i => props[i as usize].1,
                        };
                        set(&mut s, ObjSt::InValue);
                        s.frames.push(Frame::Value(value));
                        out.push(s);
                    }
                    ObjSt::After => {
                        if ws {
                            return Self::space(s, b, out);
                        }
                        if b == b'}' && may_close {
                            return out.push(self.finish(s));
                        }
                        let more = match props.is_empty() {
                            true => extra != NONE,
                            false => (next as usize) < props.len(),
                        };
                        if b == b',' && more {
                            set(&mut s, ObjSt::NeedKey);
                            if props.is_empty() {
                                if let Some(Frame::Obj { cur, .. }) = s.frames.last_mut() {
                                    *cur = NONE;
                                }
                            }
                            out.push(s);
                        }
                    }
                    ObjSt::InKey | ObjSt::InValue => {}
                }
            }
            Frame::Arr { node, st, count } => {
                let Node::Array { items, min, max } = self.nodes[node as usize] else {
                    return;
                };
                let set = |s: &mut State, st: ArrSt| {
                    *s.frames.last_mut().unwrap() = Frame::Arr { node, st, count };
                };
                match st {
                    ArrSt::Open => {
                        if ws {
                            return Self::space(s, b, out);
                        }
                        if b == b']' {
                            if min == 0 {
                                out.push(self.finish(s));
                            }
                            return;
                        }
                        if max == 0 {
                            return;
                        }
                        set(&mut s, ArrSt::InValue);
                        self.start_value(items, s, b, out);
                    }
                    ArrSt::After => {
                        if ws {
                            return Self::space(s, b, out);
                        }
                        if b == b']' && count >= min {
                            return out.push(self.finish(s));
                        }
                        if b == b',' && count < max {
                            set(&mut s, ArrSt::InValue);
                            s.frames.push(Frame::Value(items));
                            out.push(s);
                        }
                    }
                    ArrSt::InValue => {}
                }
            }
        }
    }

    /// A value of `node` starts with byte `b` (not whitespace) on top of `s`.
    fn start_value(&self, node: Id, mut s: State, b: u8, out: &mut Vec<State>) {
        match &self.nodes[node as usize] {
            Node::Pending => {}
            Node::AnyOf(alts) => {
                for &a in alts {
                    self.start_value(a, s.clone(), b, out);
                }
            }
            Node::Object { .. } => {
                if b == b'{' && Self::depth(&s) < MAX_DEPTH {
                    s.frames.push(Frame::Obj {
                        node,
                        st: ObjSt::Open,
                        next: 0,
                        cur: NONE,
                    });
                    out.push(s);
                }
            }
            Node::Array { .. } => {
                if b == b'[' && Self::depth(&s) < MAX_DEPTH {
                    s.frames.push(Frame::Arr {
                        node,
                        st: ArrSt::Open,
                        count: 0,
                    });
                    out.push(s);
                }
            }
            Node::Str { .. } => {
                if b == b'"' {
                    s.frames.push(Frame::Str {
                        node,
                        st: StrSt::Plain,
                        len: 0,
                    });
                    out.push(s);
                }
            }
            &Node::Num { integer } => {
                let st = match b {
                    b'-' => NumSt::Minus,
                    b'0' => NumSt::Zero,
                    b'1'..=b'9' => NumSt::Int,
                    _ => return,
                };
                s.frames.push(Frame::Num { integer, st });
                out.push(s);
            }
            Node::Lits(alts) => {
                for (i, text) in alts.iter().enumerate() {
                    if text.first() != Some(&b) {
                        continue;
                    }
                    let mut t = s.clone();
                    t.frames.push(Frame::Lit {
                        node,
                        alt: i as u32,
                        pos: 1,
                    });
                    if text.len() == 1 {
                        t = self.finish(t);
                    }
                    out.push(t);
                }
            }
        }
    }

    /// The states after `bytes` from `states` (sorted, without repeats, at most
    /// MAX_STATES).
    fn advance(&self, states: &[State], bytes: &[u8]) -> Vec<State> {
        let mut cur = states.to_vec();
        for &b in bytes {
            let mut next = Vec::new();
            for s in cur {
                self.feed(s, b, &mut next);
            }
            if next.len() > 1 {
                next.sort();
                next.dedup();
                next.truncate(MAX_STATES);
            }
            cur = next;
            if cur.is_empty() {
                break;
            }
        }
        cur
    }

    /// Whether `text` is a whole value this grammar allows (tests, diagnostics).
    pub fn accepts(&self, text: &str) -> bool {
        self.advance(&self.start(), text.as_bytes())
            .iter()
            .any(|s| self.complete(s))
    }
}

/// The vocabulary's bytes as a trie: tokens sharing a prefix share the grammar's work.
pub struct TokenTrie {
    nodes: Vec<TrieNode>,
    /// Each token's bytes (empty for control tokens).
    bytes: Vec<Vec<u8>>,
}

/// A trie node: its children (byte, node) and the tokens that end here.
#[derive(Default)]
struct TrieNode {
    children: Vec<(u8, u32)>,
    tokens: Vec<u32>,
}

impl TokenTrie {
    /// Every token with text (control tokens left out: never part of JSON).
    pub fn new(tk: &Tokenizer) -> TokenTrie {
        let mut nodes = vec![TrieNode::default()];
        let bytes: Vec<Vec<u8>> = (0..tk.vocab_size() as u32)
            .map(|id| match tk.is_special(id) {
                true => Vec::new(),
                false => tk.token_bytes(id).to_vec(),
            })
            .collect();
        for (id, bytes) in bytes.iter().enumerate() {
            let id = id as u32;
            if bytes.is_empty() {
                continue;
            }
            let mut at = 0usize;
            for &b in bytes {
                at = match nodes[at].children.iter().find(|c| c.0 == b) {
                    Some(c) => c.1 as usize,
                    None => {
                        nodes.push(TrieNode::default());
                        let n = nodes.len() - 1;
                        nodes[at].children.push((b, n as u32));
                        n
                    }
                };
            }
            nodes[at].tokens.push(id);
        }
        TokenTrie { nodes, bytes }
    }
}

/// A [`Grammar`] over a model's tokens: a [`TokenConstraint`] for the sampler.
pub struct JsonConstraint {
    grammar: Arc<Grammar>,
    trie: Arc<TokenTrie>,
    stop: Vec<u32>,
    states: Vec<State>,
}

impl JsonConstraint {
    /// `stop`: the model's stop tokens, allowed once the value is whole (and only then).
    pub fn new(grammar: Arc<Grammar>, trie: Arc<TokenTrie>, stop: Vec<u32>) -> JsonConstraint {
        let states = grammar.start();
        JsonConstraint {
            grammar,
            trie,
            stop,
            states,
        }
    }

    /// Whether the text so far is a whole value.
    pub fn complete(&self) -> bool {
        self.states.iter().any(|s| self.grammar.complete(s))
    }

    fn walk(&self, node: usize, states: &[State], allowed: &mut [bool]) {
        for &(b, child) in &self.trie.nodes[node].children {
            let mut next = Vec::new();
            for s in states {
                self.grammar.feed(s.clone(), b, &mut next);
            }
            if next.is_empty() {
                continue;
            }
            if next.len() > 1 {
                next.sort();
                next.dedup();
                next.truncate(MAX_STATES);
            }
            for &t in &self.trie.nodes[child as usize].tokens {
                if let Some(a) = allowed.get_mut(t as usize) {
                    *a = true;
                }
            }
            self.walk(child as usize, &next, allowed);
        }
    }
}

impl TokenConstraint for JsonConstraint {
    fn allowed(&mut self, allowed: &mut [bool]) {
        if self.complete() {
            for &t in &self.stop {
                if let Some(a) = allowed.get_mut(t as usize) {
                    *a = true;
                }
            }
        }
        self.walk(0, &self.states, allowed);
        // A stop token that is also text (an EOS the vocabulary does not mark as a
        // control token) is still no JSON: only a whole value may stop.
        let complete = self.complete();
        for &t in &self.stop {
            if let Some(a) = allowed.get_mut(t as usize) {
                *a = complete;
            }
        }
        if !allowed.iter().any(|&a| a) {
            // A dead end (a vocabulary that cannot spell what must come): stop.
            for &t in &self.stop {
                if let Some(a) = allowed.get_mut(t as usize) {
                    *a = true;
                }
            }
        }
    }

    fn accept(&mut self, id: u32) {
        if self.stop.contains(&id) {
            return;
        }
        let bytes = self
            .trie
            .bytes
            .get(id as usize)
            .map_or(&[][..], Vec::as_slice);
        self.states = self.grammar.advance(&self.states, bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn json_object_accepts_objects_only() {
        let g = Grammar::json_object();
        for ok in [
            "{}",
            r#"{"a": 1}"#,
            "{\n  \"a\": [1, 2.5e-3, -0, true, null, \"x\\n\\u00e9\"],\n  \"b\": {\"c\": {}}\n}",
            "{\"\u{e9}\u{1F600}\": \"\"}",
        ] {
            assert!(g.accepts(ok), "{ok}");
        }
        for bad in [
            "[]",
            "1",
            "{",
            "{\"a\"}",
            "{\"a\":}",
            "{\"a\":1,}",
            "{\"a\":01}",
            "{\"a\":1.}",
            "{\"a\":\"\\x\"}",
            "{\"a\":\"\\ud800\"}",
            "{} ",
            "{\"a\":tru}",
            "{\"a\":\"\n\"}",
        ] {
            assert!(!g.accepts(bad), "{bad:?}");
        }
        // Whitespace: a space, or a newline and at most MAX_INDENT blanks; none around.
        let indent = |n: usize| format!("{{\n{}\"a\": 1}}", " ".repeat(n));
        assert!(g.accepts(&indent(MAX_INDENT as usize)));
        assert!(!g.accepts(&indent(MAX_INDENT as usize + 1)));
        for bad in ["{  }", "{\n\n}", " {}", "{}\n", "{ \n}", "{\t}"] {
            assert!(!g.accepts(bad), "{bad:?}");
        }
        // Invalid UTF-8 inside a string never gets through.
        let states = g.advance(&g.start(), b"{\"a\":\"\xed\xa0\x80");
        assert!(states.is_empty());
    }

    #[test]
    fn schemas_constrain_keys_types_and_counts() {
        let s = json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 3},
                "age": {"type": "integer"},
                "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2},
                "pet": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/pet"}]}
            },
            "required": ["name", "tags"],
            "$defs": {"pet": {"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"], "additionalProperties": false}}
        });
        let g = Grammar::from_schema(&s).unwrap();
        for ok in [
            r#"{"name":"ab","tags":["a"]}"#,
            r#"{"name": "abc", "age": -12, "tags": ["a", "b"], "pet": null}"#,
            r#"{"name":"é","tags":["b"],"pet":{"kind":"cat"}}"#,
        ] {
            assert!(g.accepts(ok), "{ok}");
        }
        for bad in [
            r#"{"tags":["a"],"name":"ab"}"#,           // schema order
            r#"{"name":"","tags":["a"]}"#,             // minLength
            r#"{"name":"abcd","tags":["a"]}"#,         // maxLength
            r#"{"name":"ab","tags":[]}"#,              // minItems
            r#"{"name":"ab","tags":["a","b","a"]}"#,   // maxItems
            r#"{"name":"ab","tags":["c"]}"#,           // enum
            r#"{"name":"ab","age":1.5,"tags":["a"]}"#, // integer
            r#"{"name":"ab"}"#,                        // required
            r#"{"name":"ab","tags":["a"],"x":1}"#,     // unknown key
            r#"{"name":"ab","tags":["a"],"pet":{"kind":"dog"}}"#,
        ] {
            assert!(!g.accepts(bad), "{bad}");
        }
        // Recursion through $ref.
        let tree = json!({"$defs": {"t": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/t"}}}, "required": ["kids"]}}, "$ref": "#/$defs/t"});
        let g = Grammar::from_schema(&tree).unwrap();
        assert!(g.accepts(r#"{"kids":[{"kids":[]},{"kids":[{"kids":[]}]}]}"#));
        assert!(!g.accepts(r#"{"kids":[{}]}"#));
        // A top-level number ends at the end of the text.
        let g = Grammar::from_schema(&json!({"type": "number"})).unwrap();
        assert!(g.accepts("-1.5E+3") && !g.accepts("1e") && !g.accepts("-"));
    }

    #[test]
    fn what_the_grammar_cannot_express_is_refused_by_name() {
        for (s, word) in [
            (json!({"type": "string", "pattern": "a+"}), "pattern"),
            (json!({"type": "integer", "minimum": 0}), "minimum"),
            (json!({"type": "array", "uniqueItems": true}), "uniqueItems"),
            (
                json!({"type": "object", "properties": {"a": {"type": "date"}}}),
                "date",
            ),
            (json!({"$ref": "http://x/y"}), "http://x/y"),
            (json!({"$ref": "#/$defs/missing"}), "missing"),
            (
                json!({"type": "object", "required": ["a"], "properties": {"b": {}}}),
                "`a`",
            ),
            (json!(3), "schema"),
            // Left recursion: would never start a value.
            (
                json!({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}]}}, "$ref": "#/$defs/a"}),
                "itself",
            ),
            (json!({"anyOf": [{"$ref": "#"}]}), "itself"),
        ] {
            let e = Grammar::from_schema(&s).unwrap_err();
            assert!(e.contains(word), "{s}: {e}");
        }
        // $refs doubling at each of 30 levels (2^30 paths): compiled to one alternative.
        let mut defs = serde_json::Map::new();
        for k in 0..30 {
            let r = format!("#/$defs/d{}", k + 1);
            defs.insert(
                format!("d{k}"),
                json!({"anyOf": [{"$ref": r}, {"$ref": r}]}),
            );
        }
        defs.insert("d30".into(), json!({"type": "string"}));
        let g = Grammar::from_schema(&json!({"$defs": defs, "$ref": "#/$defs/d0"})).unwrap();
        assert!(g.accepts("\"x\"") && !g.accepts("1"));
        // A chain of 20,000 $refs compiled 50 at a time (each piece cached): no recursion
        // at run time either.
        let mut defs = serde_json::Map::new();
        for i in 0..20_000 {
            defs.insert(
                format!("a{i}"),
                json!({"$ref": format!("#/$defs/a{}", i + 1)}),
            );
        }
        defs.insert("a20000".into(), json!({"type": "integer"}));
        let pieces: Vec<Value> = (0..=20_000 / 50)
            .rev()
            .map(|k| json!({"$ref": format!("#/$defs/a{}", k * 50)}))
            .collect();
        let g = Grammar::from_schema(&json!({"$defs": defs, "anyOf": pieces})).unwrap();
        assert!(g.accepts("12") && !g.accepts("\"x\""));
        let many: Vec<i64> = (0..300).collect();
        let e = Grammar::from_schema(&json!({"enum": many})).unwrap_err();
        assert!(e.contains("256"), "{e}");
        // A chain of 10,000 $refs: refused, not a stack overflow.
        let mut defs = serde_json::Map::new();
        for i in 0..10_000 {
            defs.insert(
                format!("d{i}"),
                json!({"$ref": format!("#/$defs/d{}", i + 1)}),
            );
        }
        defs.insert("d10000".into(), json!({"type": "null"}));
        let e = Grammar::from_schema(&json!({"$defs": defs, "$ref": "#/$defs/d0"})).unwrap_err();
        assert!(e.contains("nested deeper"), "{e}");
    }
}
