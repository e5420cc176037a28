//! Cooperative matrices emulated in plain WGSL, so that the cooperative-matrix kernels
//! (`matmul_coop.wgsl`, `quant_coop.wgsl`, `attention_coop.wgsl`, `conv2d_coop.wgsl`) run
//! and are checked on adapters without them (lavapipe, in CI). Test use only: slow to
//! compile (every load, store and multiply-add unrolled) and chosen only with
//! `DOPPLER_EMULATE_COOP=on` ([`super::GpuOptions::emulate_coop`]).
//!
//! The kernel's WGSL is rewritten as text before naga sees it:
//! - `coop_mat16x16<T, R>` becomes a struct holding the lane's fragment of it (below) as
//!   f32 values (A is 16 x 16 of M x K, B of K x N, C of M x N);
//! - `coopLoad` / `coopLoadT` (naga 30: `T` is row-major) from `&name[i]` become calls of a
//!   function made for that variable: element (r, c) at component `i' + r s' + c`
//!   (row-major) or `i' + c s' + r` (column-major), where for an array of `vec4`s the
//!   index and stride count vectors (`i' = 4 i`, `s' = 4 s`) and elements are their
//!   components, as SPIR-V's `OpCooperativeMatrixLoadKHR` reads a pointer to a vector;
//! - `coopStore` / `coopStoreT` likewise (f32 accumulators only);
//! - `coopMultiplyAdd(a, b, c)`: f16 products summed in f32 over k in order (hardware sums
//!   in an order of its own: the kernels' CPU checks already allow for f16 arithmetic).
//!
//! As on hardware, a matrix is spread over a subgroup of 32 invocations (the kernels'
//! layout: subgroup `tid / 32`, lane `tid % 32`), with no subgroup operation: lane l holds
//! C's elements l, l + 32, .. (row l / 16 + 2 t, column l % 16), and of A and B what those
//! need (A's 8 rows, B's column), so `coopMultiplyAdd` is each lane's own 8 sums of 16
//! products, and the lanes of a store write the whole matrix between them. The kernels
//! already put a workgroup barrier between a store and reads of it by other lanes (so
//! also when subgroups are not 32 wide, as lavapipe's 8).

use std::collections::{BTreeMap, BTreeSet};

/// The element type of a module-scope array variable: (scalar, lanes: 1 or 4).
fn variables(text: &str) -> BTreeMap<String, (String, u32)> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let l = line.trim_start();
        let Some(at) = l.find("var<") else { continue };
        if !(l.starts_with("var<") || l.starts_with('@')) {
            continue;
        }
        let rest = &l[at + 4..];
        let Some(close) = rest.find('>') else {
            continue;
        };
        let rest = rest[close + 1..].trim_start();
        let Some(colon) = rest.find(':') else {
            continue;
        };
        let name = rest[..colon].trim().to_string();
        let ty = rest[colon + 1..].trim_start();
        let Some(elem) = ty.strip_prefix("array<") else {
            continue;
        };
        let (scalar, lanes) = match elem.strip_prefix("vec4<") {
            Some(v) => (v.split('>').next().unwrap_or("").trim().to_string(), 4),
            None => (
                elem.split([',', '>'])
                    .next()
                    .unwrap_or("")
                    .trim()
                    .to_string(),
                1,
            ),
        };
        out.insert(name, (scalar, lanes));
    }
    out
}

/// Index of the bracket closing the one opened at `open` (`(` or `[`), skipping nested ones.
fn closing(s: &[u8], open: usize) -> Option<usize> {
    let mut depth = 0i32;
    for (i, &c) in s.iter().enumerate().skip(open) {
        match c {
            b'(' | b'[' => depth += 1,
            b')' | b']' => {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
    }
    None
}

/// Top-level comma-separated arguments of `s` (the text between a call's parentheses).
fn arguments(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in s.char_indices() {
        match c {
            '(' | '[' => depth += 1,
            ')' | ']' => depth -= 1,
            ',' if depth == 0 => {
                out.push(s[start..i].trim().to_string());
                start = i + 1;
            }
            _ => {}
        }
    }
    let last = s[start..].trim();
    if !last.is_empty() {
        out.push(last.to_string());
    }
    out
}

/// `&name[index]` as (name, index).
fn pointer(arg: &str) -> Option<(String, String)> {
    let a = arg.trim().strip_prefix('&')?.trim();
    let open = a.find('[')?;
    let close = closing(a.as_bytes(), open)?;
    if close != a.len() - 1 {
        return None;
    }
    Some((a[..open].trim().to_string(), a[open + 1..close].to_string()))
}

/// Statements `x = (y * a) * b;` with y a cooperative matrix (a scalar times a matrix,
/// each element rounded): as `x = coop_scale(coop_scale(y, a), b);`. The only arithmetic
/// on matrices the kernels use besides `coopMultiplyAdd` (matmul_coop.wgsl's f16x3
/// scales).
fn scaled(text: &str) -> String {
    let mut mats = BTreeSet::new();
    for l in text.lines() {
        let l = l.trim();
        if let Some(d) = l.strip_prefix("var ") {
            if let Some((name, ty)) = d.split_once(':') {
                if ty.trim().starts_with("coop_mat16x16<f32, C>") {
                    mats.insert(name.trim().to_string());
                }
            }
        }
    }
    let mut out = Vec::new();
    for line in text.lines() {
        let l = line.trim();
        let indent = &line[..line.len() - line.trim_start().len()];
        let parsed = (|| {
            let (x, rhs) = l.strip_suffix(';')?.split_once(" = ")?;
            let (inner, b) = rhs.strip_prefix('(')?.split_once(") * ")?;
            let (y, a) = inner.split_once(" * ")?;
            let word = |s: &str| s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            (mats.contains(y) && word(x) && word(a) && word(b))
                .then(|| format!("{indent}{x} = coop_scale(coop_scale({y}, {a}), {b});"))
        })();
        out.push(parsed.unwrap_or_else(|| line.to_string()));
    }
    out.join("\n")
}

/// The elements a lane holds of a matrix of `role`, as (row, column) expressions of
/// `cm_lane`: C's l, l + 32, .. (rows l / 16 + 2 t, column l % 16), and what their sums
/// need: A's rows of them (8 rows of 16), B's column (16).
fn fragment(role: &str) -> Option<Vec<(String, String)>> {
    let row = |t: usize| format!("cm_lane / 16u + {}u", 2 * t);
    Some(match role {
        "A" => (0..128)
            .map(|q| (row(q / 16), format!("{}u", q % 16)))
            .collect(),
        "B" => (0..16)
            .map(|k| (format!("{k}u"), "cm_lane % 16u".into()))
            .collect(),
        "C" => (0..8).map(|t| (row(t), "cm_lane % 16u".into())).collect(),
        _ => return None,
    })
}

/// The struct standing for `coop_mat16x16<scalar, role>`.
fn struct_name(scalar: &str, role: &str) -> String {
    format!("CoopM_{scalar}_{role}")
}

/// What [`calls`] rewrote: matrix types, loads (variable, scalar, role, row-major) and
/// stores (variable, row-major).
#[derive(Default)]
struct Found {
    structs: BTreeSet<(String, String)>,
    loads: BTreeSet<(String, String, String, bool)>,
    stores: BTreeSet<(String, bool)>,
}

/// `text` with its cooperative-matrix builtin calls rewritten (arguments first, so that
/// a load inside `coopMultiplyAdd`'s arguments is rewritten before they are split).
fn calls(
    text: &str,
    vars: &BTreeMap<String, (String, u32)>,
    found: &mut Found,
) -> Result<String, String> {
    let mut out = String::with_capacity(text.len() * 2);
    let mut rest = text.to_string();
    loop {
        let Some(at) = rest.find("coop") else {
            out.push_str(&rest);
            break;
        };
        out.push_str(&rest[..at]);
        let tail = &rest[at..];
        let word_end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        let word = &tail[..word_end];
        let is_load = word == "coopLoad" || word == "coopLoadT";
        let is_store = word == "coopStore" || word == "coopStoreT";
        let is_mad = word == "coopMultiplyAdd";
        if !(is_load || is_store || is_mad) {
            out.push_str(word);
            rest = tail[word_end..].to_string();
            continue;
        }
        let row_major = word.ends_with('T');
        let mut after = &tail[word_end..];
        let mut mat = None;
        if is_load {
            // coopLoad<coop_mat16x16<T, R>>(
            let t = after
                .strip_prefix("<coop_mat16x16<")
                .ok_or_else(|| format!("{word} without coop_mat16x16<..> type"))?;
            let end = t
                .find(">>")
                .ok_or_else(|| format!("{word}: unclosed type"))?;
            let parts: Vec<&str> = t[..end].split(',').map(str::trim).collect();
            if parts.len() != 2 {
                return Err(format!("{word}: type {:?}", &t[..end]));
            }
            mat = Some((parts[0].to_string(), parts[1].to_string()));
            after = &t[end + 2..];
        }
        let after_b = after.as_bytes();
        if after_b.first() != Some(&b'(') {
            return Err(format!("{word} not called"));
        }
        let close = closing(after_b, 0).ok_or_else(|| format!("{word}: unclosed call"))?;
        let inner = calls(&after[1..close], vars, found)?;
        let args = arguments(&inner);
        let call = if is_mad {
            if args.len() != 3 {
                return Err(format!("coopMultiplyAdd with {} arguments", args.len()));
            }
            format!("coop_mad({}, {}, {})", args[0], args[1], args[2])
        } else {
            let (ptr, stride, value) = match (is_load, args.len()) {
                (true, 2) => (&args[0], &args[1], None),
                (false, 3) => (&args[1], &args[2], Some(&args[0])),
                _ => {
                    return Err(format!(
                        "{word} with {} arguments (stride needed)",
                        args.len()
                    ))
                }
            };
            let (name, index) = pointer(ptr)
                .ok_or_else(|| format!("{word}: pointer {ptr:?} is not &name[index]"))?;
            if !vars.contains_key(&name) {
                return Err(format!("{word}: {name} is not a module-scope array"));
            }
            let order = if row_major { "r" } else { "c" };
            match (value, mat) {
                (None, Some((scalar, role))) => {
                    found.structs.insert((scalar.clone(), role.clone()));
                    let f = format!("coop_ld_{name}_{scalar}_{role}_{order}");
                    found.loads.insert((name, scalar, role, row_major));
                    format!("{f}({index}, {stride})")
                }
                (Some(v), _) => {
                    found.structs.insert(("f32".into(), "C".into()));
                    found.stores.insert((name.clone(), row_major));
                    format!("coop_st_{name}_{order}({v}, {index}, {stride})")
                }
                (None, None) => return Err(format!("{word} without a matrix type")),
            }
        };
        out.push_str(&call);
        rest = after[close + 1..].to_string();
    }
    Ok(out)
}

/// Each entry point's first statement sets `cm_lane`, the invocation's lane in its
/// subgroup of 32 (the kernels' layout: subgroup `tid / 32`), from its
/// `@builtin(local_invocation_index)` parameter.
fn lane_set(text: &str) -> Result<String, String> {
    let mut out = String::with_capacity(text.len() + 256);
    let mut rest = text;
    while let Some(at) = rest.find("@compute") {
        let fn_at = at + rest[at..].find("fn ").ok_or("@compute without fn")?;
        let open = fn_at + rest[fn_at..].find('(').ok_or("entry point without (")?;
        let close = closing(rest.as_bytes(), open).ok_or("entry point: unclosed (")?;
        let params = &rest[open..close];
        let key = "@builtin(local_invocation_index)";
        let p = params
            .find(key)
            .ok_or("an entry point without @builtin(local_invocation_index)")?;
        let name = params[p + key.len()..]
            .split(':')
            .next()
            .unwrap_or("")
            .trim()
            .to_string();
        let body = close + rest[close..].find('{').ok_or("entry point without body")?;
        out.push_str(&rest[..=body]);
        out.push_str(&format!("\n    cm_lane = {name} % 32u;"));
        rest = &rest[body + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// The kernel's WGSL with its cooperative matrices emulated (see the module's doc), or
/// what could not be rewritten. The text as written is validated first, with the
/// cooperative capability, as a driver that has it would (e.g. cooperative operations
/// in control flow that differs between a subgroup's invocations are refused there, and
/// would not be once rewritten).
pub(crate) fn rewrite(text: &str) -> Result<String, String> {
    super::spirv::validated(text)
        .map_err(|e| format!("as written (with cooperative matrices): {e}"))?;
    // Line comments out (they name the builtins too).
    let text: String = text
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let text = scaled(&text);
    let text = text.as_str();
    let vars = variables(text);
    let mut found = Found::default();
    let text = text.replace("enable wgpu_cooperative_matrix;", "");
    // Calls first (their template arguments name the matrix type), then the types.
    let out = calls(&text, &vars, &mut found)?;
    let Found {
        mut structs,
        loads,
        stores,
    } = found;
    // Types and constructors.
    let mut text = String::with_capacity(out.len());
    let mut rest = out.as_str();
    while let Some(at) = rest.find("coop_mat16x16<") {
        text.push_str(&rest[..at]);
        let t = &rest[at + "coop_mat16x16<".len()..];
        let end = t.find('>').ok_or("coop_mat16x16: unclosed type")?;
        let parts: Vec<&str> = t[..end].split(',').map(str::trim).collect();
        if parts.len() != 2 {
            return Err(format!("coop_mat16x16<{}>", &t[..end]));
        }
        structs.insert((parts[0].to_string(), parts[1].to_string()));
        text.push_str(&struct_name(parts[0], parts[1]));
        rest = &t[end + 1..];
    }
    text.push_str(rest);
    let text = lane_set(&text)?;
    let mut lib = String::from(
        "\n// --- cooperative matrices emulated (gpu/coop_emulate.rs) ---\n\
         var<private> cm_lane: u32;\n",
    );
    for (scalar, role) in &structs {
        let n = fragment(role)
            .ok_or_else(|| format!("coop_mat16x16<{scalar}, {role}>: unknown role"))?
            .len();
        // Values held as f32 (an f16's value exactly): lavapipe converts f16 in software.
        lib += &format!(
            "struct {} {{ v: array<f32, {n}> }}\n",
            struct_name(scalar, role)
        );
    }
    // Unrolled, every index into a fragment a constant: the fragments stay in registers.
    if text.contains("coop_mad(") {
        lib += "fn coop_mad(cm_a: CoopM_f16_A, cm_b: CoopM_f16_B, cm_c: CoopM_f32_C) -> CoopM_f32_C {\n    var cm_m = cm_c;\n";
        for t in 0..8 {
            lib += &format!("    var cm_s{t} = cm_c.v[{t}];\n");
            for k in 0..16 {
                lib += &format!("    cm_s{t} += cm_a.v[{}] * cm_b.v[{k}];\n", t * 16 + k);
            }
            lib += &format!("    cm_m.v[{t}] = cm_s{t};\n");
        }
        lib += "    return cm_m;\n}\n";
    }
    if text.contains("coop_scale(") {
        lib +=
            "fn coop_scale(cm_m: CoopM_f32_C, cm_f: f32) -> CoopM_f32_C {\n    var cm_r = cm_m;\n";
        for t in 0..8 {
            lib += &format!("    cm_r.v[{t}] = cm_m.v[{t}] * cm_f;\n");
        }
        lib += "    return cm_r;\n}\n";
    }
    // Element (r, c) of the matrix at `name[cm_i]` with stride `cm_stride`.
    let at = |name: &str, lanes: u32, row_major: bool, r: &str, c: &str| {
        let (major, minor) = if row_major { (r, c) } else { (c, r) };
        match lanes {
            4 => format!("{name}[cm_i + ({major}) * cm_stride + ({minor}) / 4u][({minor}) % 4u]"),
            _ => format!("{name}[cm_i + ({major}) * cm_stride + {minor}]"),
        }
    };
    for (name, scalar, role, row_major) in &loads {
        let (_, lanes) = &vars[name];
        let order = if *row_major { "r" } else { "c" };
        let st = struct_name(scalar, role);
        lib += &format!(
            "fn coop_ld_{name}_{scalar}_{role}_{order}(cm_i: u32, cm_stride: u32) -> {st} {{\n    var cm_m: {st};\n"
        );
        for (q, (r, c)) in fragment(role).unwrap_or_default().iter().enumerate() {
            lib += &format!(
                "    cm_m.v[{q}] = f32({scalar}({}));\n",
                at(name, *lanes, *row_major, r, c)
            );
        }
        lib += "    return cm_m;\n}\n";
    }
    for (name, row_major) in &stores {
        let (scalar, lanes) = &vars[name];
        if scalar != "f32" {
            return Err(format!(
                "coopStore into {name} of {scalar}: only f32 accumulators"
            ));
        }
        let order = if *row_major { "r" } else { "c" };
        lib += &format!(
            "fn coop_st_{name}_{order}(cm_m: CoopM_f32_C, cm_i: u32, cm_stride: u32) {{\n"
        );
        for (q, (r, c)) in fragment("C").unwrap_or_default().iter().enumerate() {
            lib += &format!(
                "    {} = cm_m.v[{q}];\n",
                at(name, *lanes, *row_major, r, c)
            );
        }
        lib += "}\n";
    }
    Ok(text + &lib)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shader_the_hardware_would_refuse_is_refused() {
        // Cooperative operations under a branch on the invocation's index: valid once
        // rewritten (plain loads and sums), invalid as written.
        let text = "enable f16;\nenable wgpu_cooperative_matrix;\n\
            var<workgroup> sa: array<f16, 256>;\n\
            @compute @workgroup_size(64)\n\
            fn k(@builtin(local_invocation_index) tid: u32) {\n\
                var c = coop_mat16x16<f32, C>();\n\
                if (tid < 32u) {\n\
                    let a = coopLoad<coop_mat16x16<f16, A>>(&sa[0], 16u);\n\
                    let b = coopLoad<coop_mat16x16<f16, B>>(&sa[0], 16u);\n\
                    c = coopMultiplyAdd(a, b, c);\n\
                }\n\
            }\n";
        let err = rewrite(text).unwrap_err();
        assert!(
            err.contains("as written") && err.contains("niform"),
            "{err}"
        );
        let uniform = text.replace("if (tid < 32u)", "if (true)");
        rewrite(&uniform).unwrap_or_else(|e| panic!("{e}"));
    }

    #[test]
    fn every_coop_shader_rewrites_and_validates() {
        for shader in crate::shaders::ALL {
            let text = shader.text();
            if !text.contains("wgpu_cooperative_matrix") {
                continue;
            }
            let out = rewrite(&text).unwrap_or_else(|e| panic!("{}: {e}", shader.name));
            assert!(!out.contains("coop_mat16x16"), "{}", shader.name);
            assert!(!out.contains("coopLoad"), "{}", shader.name);
            let module = naga::front::wgsl::parse_str(&out)
                .unwrap_or_else(|e| panic!("{}: {}", shader.name, e.emit_to_string(&out)));
            naga::valid::Validator::new(
                naga::valid::ValidationFlags::all(),
                naga::valid::Capabilities::all() - naga::valid::Capabilities::COOPERATIVE_MATRIX,
            )
            .validate(&module)
            .unwrap_or_else(|e| panic!("{}: {}", shader.name, e.emit_to_string(&out)));
        }
    }

    #[test]
    fn loads_read_rows_or_columns_of_vectors() {
        let src = "enable f16;\nenable wgpu_cooperative_matrix;\n\
            var<workgroup> sa: array<vec4<f16>, 64>;\n\
            var<workgroup> sb: array<f16, 256>;\n\
            // coopLoad in a comment\n\
            fn f() { let a = coopLoadT<coop_mat16x16<f16, A>>(&sa[2u * 4u], 4u);\n\
            let b = coopLoad<coop_mat16x16<f16, B>>(&sb[3u], 16u); }\n";
        let out = rewrite(src).unwrap();
        assert!(!out.contains("wgpu_cooperative_matrix"));
        assert!(out.contains("coop_ld_sa_f16_A_r(2u * 4u, 4u)"), "{out}");
        assert!(out.contains("coop_ld_sb_f16_B_c(3u, 16u)"), "{out}");
        // A's element 21 of lane l: row l / 16 + 2, column 5, row-major in vec4s.
        let a21 = "cm_m.v[21] = f32(f16(sa[cm_i + (cm_lane / 16u + 2u) * cm_stride + (5u) / 4u][(5u) % 4u]));";
        assert!(out.contains(a21), "{out}");
        // B's element 7: row 7, column l % 16, column-major (columns cm_stride apart).
        let b7 = "cm_m.v[7] = f32(f16(sb[cm_i + (cm_lane % 16u) * cm_stride + 7u]));";
        assert!(out.contains(b7), "{out}");
    }
}
