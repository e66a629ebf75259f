"""The SQL guard: accept one read-only query over registered tables, refuse the rest.

Validation is done on sqlglot's syntax tree, never with regular expressions:

* exactly one statement, and it must be a query (SELECT, WITH ... SELECT, UNION ...),
  or ``DESCRIBE t`` / ``SHOW TABLES``, which are rewritten to queries on the registry;
* no node anywhere that writes, attaches, loads, sets or copies;
* every table referenced is a registered table or a CTE *visible in its scope* (names are
  resolved with sqlglot's scope tools, so a CTE named like a DuckDB catalog view cannot
  be used outside the subquery that defines it); table functions are limited to
  ``range``/``generate_series``/``unnest``;
* every function called is on the allow-list ``ALLOWED_FUNCTIONS`` (pure functions only).

DuckDB is then configured with external access disabled and its configuration
locked (see ``engine``), so the guard is one of two independent walls; and DuckDB runs
in the client, never in the training process.

The functions a query may call (``ALLOWED_FUNCTIONS``, at the end of this module) are DuckDB's pure scalar,
aggregate and window functions and macros. An allow-list, not a deny-list: a function missing here is refused by
the guard even if DuckDB has it. Left out on purpose: everything that reads files or the network (``read_*``,
``glob``, ``parquet_*``), reads or changes settings, variables or sequences (``current_setting``,
``getvariable``, ``setseed``, ``nextval``), runs SQL given as a string (``query``,
``json_execute_serialized_sql``), inspects the database (``duckdb_*``, ``pragma_*``, ``pg_*`` catalog helpers),
sleeps, or logs. The list was taken from ``duckdb_functions()`` of DuckDB 1.x/2.0 and reviewed by hand; a newer
DuckDB's new functions need adding here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable

import sqlglot
from sqlglot import exp
from sqlglot.errors import ParseError, TokenError

from probe._errors import QueryError, exception_text


logging.getLogger("sqlglot").setLevel(logging.ERROR)

READ_ONLY_ROOTS = (exp.Query,)

_FORBIDDEN_NODES = tuple(
    getattr(exp, name)
    for name in (
        "Insert",
        "Update",
        "Delete",
        "Merge",
        "Create",
        "Drop",
        "Alter",
        "AlterTable",
        "Copy",
        "Command",
        "Pragma",
        "Set",
        "SetItem",
        "Use",
        "Attach",
        "Detach",
        "Install",
        "Load",
        "TruncateTable",
        "Transaction",
        "Commit",
        "Rollback",
        "Export",
        "Into",
        "LoadData",
        "Analyze",
    )
    if hasattr(exp, name)
)

MAX_SQL_CHARS = 100_000
_TOO_DEEP = "the query nests too deeply to read (brackets or subqueries hundreds of levels deep); simplify it."
_CALL = __import__("re").compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*\(")
_ALLOWED_TABLE_FUNCTIONS = (
    (exp.GenerateSeries, exp.Unnest, exp.Explode) if hasattr(exp, "Explode") else (exp.GenerateSeries, exp.Unnest)
)


@dataclass(frozen=True)
class Guarded:
    """A query that passed the guard: DuckDB SQL text and the registered tables it reads."""

    sql: str
    tables: tuple[str, ...]
    expression: exp.Expression


def _parse(sql: str) -> list[exp.Expression]:
    if len(sql) > MAX_SQL_CHARS:
        raise QueryError(f"the query is {len(sql)} characters long; the limit is {MAX_SQL_CHARS}.")
    try:
        statements = [s for s in sqlglot.parse(sql, read="duckdb") if s is not None]
    except ParseError as e:
        first = e.errors[0] if e.errors else {}
        desc = str(first.get("description", e)).split(" <Token")[0]
        line, col = first.get("line"), first.get("col")
        near = first.get("highlight")
        where = f" at line {line}, column {col}" if line else ""
        near_txt = f" near '{near}'" if near else ""
        raise QueryError(
            f"SQL syntax error{where}{near_txt}: {desc}; fix the query and retry.", line=line, col=col
        ) from None
    except TokenError as e:
        raise QueryError(f"SQL could not be read ({e}); check quotes and brackets.") from None
    if not statements:
        raise QueryError("the query is empty; pass a SELECT statement.")
    if len(statements) > 1:
        raise QueryError("only one statement per query is allowed; send the statements one at a time.")
    return statements


def unreadable(exc: BaseException, name: str | None = None) -> QueryError:
    """The refusal of a query that sqlglot failed on in a way of its own (not a syntax error it reports):
    usually a function called with arguments it cannot translate, e.g. ``date()`` or ``datetime('a')``.

    >>> unreadable(IndexError("list index out of range")).message
    'the query could not be read (IndexError: list index out of range); check the arguments of its function calls.'
    """
    if isinstance(exc, RecursionError):
        return QueryError(_TOO_DEEP)
    what = f"{name}() with these arguments" if name else "the query"
    return QueryError(f"{what} could not be read ({exception_text(exc)}); check the arguments of its function calls.")


def _sql_name(node: exp.Func) -> str:
    try:
        return node.sql_name().lower()
    except Exception:  # an abstract function class: its key is still its name
        return node.key


def _function_name(node: exp.Expression) -> str:
    """The name DuckDB would see for a function call node ("" for syntax such as CURRENT_DATE)."""
    if isinstance(node, exp.Anonymous):
        return str(node.this).lower()
    if isinstance(node, exp.Func):
        try:
            text = node.sql(dialect="duckdb")
        except Exception as exc:  # e.g. DATE() with no argument: sqlglot cannot write it back
            raise unreadable(exc, _sql_name(node)) from None
        m = _CALL.match(text)
        return m.group(1).lower() if m else ""
    return ""


def _check_functions(stmt: exp.Expression) -> None:
    for node in stmt.walk():
        if isinstance(node, _FORBIDDEN_NODES):
            raise QueryError(f"{node.key.upper()} is not allowed inside a query; probe runs read-only SQL.")
        if isinstance(node, exp.Table) and not isinstance(node.this, exp.Identifier):
            continue  # a table function: checked with the tables
        if isinstance(node, (exp.Func, exp.Anonymous)) and not isinstance(node.parent, exp.Table):
            name = _function_name(node)
            if name and name not in ALLOWED_FUNCTIONS:
                raise QueryError(
                    f"function {name}() is not allowed: queries may call only DuckDB's pure functions "
                    "(no files, settings, catalog or SQL strings); query probe's tables instead."
                )


def _check_tables(stmt: exp.Expression, known: set) -> list[str]:
    """Resolve every table by scope; return the registered tables read, in order of appearance."""
    from sqlglot.optimizer.scope import traverse_scope

    by_short: dict[str, list[str]] = {}
    for full in known:
        by_short.setdefault(full.split(".", 1)[1], []).append(full)
    try:
        scopes = traverse_scope(stmt)
    except RecursionError:
        raise QueryError(_TOO_DEEP) from None
    except Exception as exc:  # sqlglot could not resolve the names: refuse rather than guess
        raise QueryError(f"the query's table names could not be resolved ({exc}); simplify it.") from None
    cte_refs: set = set()
    in_scope: set = set()
    for scope in scopes:
        for tbl in scope.tables:
            in_scope.add(id(tbl))
            if not tbl.db and tbl.name in scope.cte_sources:
                cte_refs.add(id(tbl))
    used: list[str] = []
    for tbl in list(stmt.find_all(exp.Table)):
        if not isinstance(tbl.this, exp.Identifier):
            fn = _function_name(tbl.this) or type(tbl.this).__name__.lower()
            if isinstance(tbl.this, _ALLOWED_TABLE_FUNCTIONS) or fn in ALLOWED_TABLE_FUNCTIONS:
                continue
            raise QueryError(
                f"table function {fn}() is not allowed; query probe's tables (see `probe ENDPOINT tables`)."
            )
        if id(tbl) in cte_refs:
            continue
        db, name = tbl.db.lower(), tbl.name.lower()
        if tbl.catalog:
            raise QueryError(f"catalog-qualified table {tbl.sql()} is not allowed; use schema.table.")
        full = f"{db}.{name}" if db else None
        if full is None and len(by_short.get(name, ())) == 1:
            full = by_short[name][0]
            tbl.set("db", exp.to_identifier(full.split(".")[0]))
        if full not in known or id(tbl) not in in_scope:
            listing = ", ".join(sorted(known))
            shown = tbl.sql(dialect="duckdb")
            raise QueryError(f"unknown table {shown}; known tables: {listing}.", table=shown)
        if full not in used:
            used.append(full)
    return used


def _rewrite_meta(stmt: exp.Expression) -> exp.Expression:
    """DESCRIBE t and SHOW TABLES become queries on the registry tables."""
    if isinstance(stmt, exp.Describe):
        target = stmt.this
        name = ".".join(p for p in (getattr(target, "db", ""), getattr(target, "name", "")) if p)
        return sqlglot.parse_one(
            "SELECT column_name, type AS column_type, description FROM probe.columns "
            f"WHERE table_name = {exp.Literal.string(name.lower()).sql()} ORDER BY position",
            read="duckdb",
        )
    if isinstance(stmt, exp.Show) and str(stmt.name).upper() == "TABLES":
        return sqlglot.parse_one("SELECT name, description FROM probe.tables ORDER BY name", read="duckdb")
    return stmt


def guard(sql: str, known_tables: Iterable[str] | Callable[[], Iterable[str]]) -> Guarded:
    """Check ``sql`` and resolve its tables against ``known_tables`` (``schema.table`` names).

    >>> guard("SELECT 1 AS x", []).sql
    'SELECT 1 AS x'
    >>> guard("SELECT name FROM threads", ["python.threads"]).tables
    ('python.threads',)
    """
    try:
        stmt = _rewrite_meta(_parse(sql)[0])
    except QueryError:
        raise
    except Exception as exc:  # sqlglot's own builders fail on some calls (var_map('a')): the query is the cause
        raise unreadable(exc) from None
    if not isinstance(stmt, READ_ONLY_ROOTS):
        kind = stmt.key.upper() if hasattr(stmt, "key") else type(stmt).__name__
        raise QueryError(
            f"only read queries are allowed (SELECT or WITH ... SELECT), not {kind}; probe's tables are read-only."
        )
    try:
        _check_functions(stmt)
        used = _check_tables(stmt, set(known_tables() if callable(known_tables) else known_tables))
        text = stmt.sql(dialect="duckdb")
    except QueryError:
        raise
    except Exception as exc:  # whatever sqlglot raises on a query it accepted reading: refused, one sentence
        raise unreadable(exc) from None
    return Guarded(text, tuple(used), stmt)


ALLOWED_FUNCTIONS = frozenset(
    """
    coalesce row_number rank dense_rank percent_rank cume_dist ntile lag lead first_value last_value nth_value
    DISTINCT FROM IS NOT abs acos acosh add age aggregate ago alias any_value apply approx_count_distinct
    approx_quantile approx_top_k arbitrary arg_max arg_max_null arg_max_nulls_last arg_min arg_min_null
    arg_min_nulls_last argmax argmin array array_agg array_aggr array_aggregate array_append array_apply
    array_cat array_concat array_contains array_cosine_distance array_cosine_similarity array_cross_product
    array_distance array_distinct array_dot_product array_extract array_filter array_grade_up array_has
    array_has_all array_has_any array_indexof array_inner_product array_intersect array_length
    array_negative_dot_product array_negative_inner_product array_pop_back array_pop_front array_position
    array_prepend array_push_back array_push_front array_reduce array_resize array_reverse array_reverse_sort
    array_select array_slice array_sort array_to_json array_to_string array_to_string_comma_default
    array_transform array_unique array_value array_where array_zip ascii asin asinh assert_true atan atan2
    atanh avg bar base64 bin binom bit_and bit_count bit_length bit_or bit_position bit_xor bitstring
    bitstring_agg bitstring_byte_comparable bool_and bool_or cardinality case cast cast_to_type cbrt ceil
    ceiling century char_length character_length chr collate_aa collate_af collate_am collate_ar collate_ar_sa
    collate_as collate_az collate_bal collate_be collate_bg collate_blo collate_bn collate_bo collate_br
    collate_bs collate_ca collate_ceb collate_chr collate_cs collate_cu collate_cy collate_da collate_de
    collate_de_at collate_dsb collate_dz collate_ee collate_el collate_en collate_en_us collate_eo collate_es
    collate_et collate_fa collate_fa_af collate_ff collate_fi collate_fil collate_fo collate_fr collate_fr_ca
    collate_fy collate_ga collate_gl collate_gu collate_ha collate_haw collate_he collate_he_il collate_hi
    collate_hr collate_hsb collate_hu collate_hy collate_id collate_id_id collate_ig collate_is collate_it
    collate_ja collate_ka collate_kk collate_kl collate_km collate_kn collate_ko collate_kok collate_ku
    collate_ky collate_lb collate_lij collate_lkt collate_ln collate_lo collate_lt collate_lv collate_mk
    collate_ml collate_mn collate_mr collate_ms collate_mt collate_my collate_nb collate_nb_no collate_ne
    collate_nl collate_nn collate_no collate_noaccent collate_nso collate_om collate_or collate_pa
    collate_pa_in collate_pl collate_ps collate_pt collate_ro collate_ru collate_sa collate_se collate_sgs
    collate_si collate_sk collate_sl collate_smn collate_sq collate_sr collate_sr_ba collate_sr_me
    collate_sr_rs collate_ssy collate_st collate_sv collate_sw collate_ta collate_te collate_th collate_tk
    collate_tn collate_to collate_tr collate_ug collate_uk collate_ur collate_uz collate_vi collate_vo
    collate_wae collate_wo collate_xh collate_yi collate_yo collate_zh collate_zh_cn collate_zh_hk
    collate_zh_mo collate_zh_sg collate_zh_tw collate_zu columns combine_aggr concat concat_ws contains corr
    cos cosh cot count count_if count_star countif covar_pop covar_samp current_date current_localtime
    current_localtimestamp damerau_levenshtein date_add date_diff date_part date_sub date_trunc datediff
    datepart datesub datetrunc day dayname dayofmonth dayofweek dayofyear days_in_month decade decimal_average
    decimal_division decode degrees divide editdist3 element_at encode ends_with entropy enum_code enum_first
    enum_last enum_range enum_range_boundary epoch epoch_ms epoch_ns epoch_us equi_width_bins era error even
    exists exp extract factorial favg fdiv filter first flatten floor fmod format formatReadableDecimalSize
    formatReadableSize format_bytes from_base64 from_binary from_hex from_json from_json_strict fsum gamma gcd
    gen_random_uuid generate_series generate_subscripts geomean geometric_mean get_bit get_current_time
    get_current_timestamp get_type grade_up greatest greatest_common_divisor group_concat hamming hash hex
    histogram histogram_exact hive_partition_component hour if ilike_escape index_key instr interval invoke
    is_histogram_other_bin isfinite isinf isnan isodow isoyear jaccard jaro_similarity jaro_winkler_similarity
    json json_array json_array_length json_contains json_copy_strftime_if_date json_copy_strftime_if_timestamp
    json_deep_merge json_exists json_extract json_extract_path json_extract_path_text json_extract_string
    json_group_array json_group_object json_group_structure json_insert json_keys json_merge_patch
    json_merge_patch_diff json_normalize json_object json_pretty json_quote json_remove json_replace json_set
    json_strip_nulls json_structure json_transform json_transform_strict json_type json_valid json_value
    julian kahan_sum kurtosis kurtosis_pop last last_day lcase lcm least least_common_multiple left
    left_grapheme len length length_grapheme levenshtein lgamma like_escape list list_aggr list_aggregate
    list_any_value list_append list_apply list_approx_count_distinct list_avg list_bit_and list_bit_or
    list_bit_xor list_bool_and list_bool_or list_cat list_concat list_contains list_cosine_distance
    list_cosine_similarity list_count list_distance list_distinct list_dot_product list_element list_entropy
    list_extract list_filter list_first list_grade_up list_has list_has_all list_has_any list_histogram
    list_indexof list_inner_product list_intersect list_kurtosis list_kurtosis_pop list_last list_mad list_max
    list_median list_min list_mode list_negative_dot_product list_negative_inner_product list_pack
    list_position list_prepend list_product list_reduce list_resize list_reverse list_reverse_sort list_select
    list_sem list_skewness list_slice list_sort list_stddev_pop list_stddev_samp list_string_agg list_sum
    list_transform list_unique list_value list_var_pop list_var_samp list_where list_zip listagg ln log log10
    log2 lower lpad ltrim lttb mad make_date make_time make_timestamp make_timestamp_ms make_timestamp_ns
    make_timestamptz map map_concat map_contains map_contains_entry map_contains_value map_entries map_extract
    map_extract_value map_from_entries map_keys map_values max max_by md5 md5_number md5_number_lower
    md5_number_upper mean median microsecond millennium millisecond min min_by minute mismatches mod mode
    month monthname multiply nanosecond nextafter nfc_normalize normalized_interval not_ilike_escape
    not_like_escape now nullif octet_length ord overlay parse_dirname parse_dirpath parse_filename
    parse_formatted_bytes parse_path path_join pg_size_pretty pg_typeof pi position pow power prefix printf
    product quantile quantile_cont quantile_disc quarter radians random range reduce regexp_escape
    regexp_extract regexp_extract_all regexp_full_match regexp_matches regexp_replace regexp_split_to_array
    regexp_split_to_table regr_avgx regr_avgy regr_count regr_intercept regr_r2 regr_slope regr_sxx regr_sxy
    regr_syy remap_struct repeat replace replace_type reservoir_quantile reverse right right_grapheme round
    round_even roundbankers row row_to_json rpad rtrim second sem set_bit sha1 sha256 sign signbit sin sinh
    skewness split split_part sqrt st_asbinary st_asgeojson st_astext st_aswkb st_aswkt st_crs
    st_geomfromgeojson st_geomfromwkb st_intersects_extent st_setcrs starts_with stddev stddev_pop stddev_samp
    str_split str_split_regex strftime string_agg string_split string_split_regex string_to_array
    strip_accents strlen strpos strptime struct_concat struct_contains struct_extract struct_extract_at
    struct_has struct_indexof struct_insert struct_keys struct_pack struct_position struct_update
    struct_values substr substring substring_grapheme subtract suffix sum sum_no_overflow sumkahan switch tan
    tanh time_bucket timetz_byte_comparable timezone timezone_hour timezone_minute to_aggregate_state to_base
    to_base64 to_binary to_centuries to_days to_decades to_hex to_hours to_json to_microseconds to_millennia
    to_milliseconds to_minutes to_months to_quarters to_seconds to_timestamp to_weeks to_years today
    transaction_timestamp translate trim trunc try_cast try_strptime typeof ucase unbin unhex unicode
    union_extract union_tag union_value unnest unpivot_list upper url_decode url_encode uuid
    uuid_extract_timestamp uuid_extract_version uuidv4 uuidv7 var_pop var_samp variance vertex_extract wavg
    week weekday weekofyear weighted_avg xor year yearweek
""".split()
)

# table functions a FROM clause may call (they make rows from their arguments, nothing else)
ALLOWED_TABLE_FUNCTIONS = frozenset(("range", "generate_series", "unnest"))
