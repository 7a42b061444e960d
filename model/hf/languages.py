"""The language codes of multilingual translators (NLLB-200, M2M100, mBART-50) as their `transformers` tokenizers use
them: which codes a directory's tokenizer knows, the source layout (the source language token and ``</s>`` around a
text's tokens) and the target language's token id (what ``forced_bos_token_id`` is set to).

NllbTokenizer: ``[src_lang] tokens </s>``, or ``tokens </s> [src_lang]`` with ``legacy_behaviour``; its codes are
tokenizer_config.json's ``extra_special_tokens`` / ``additional_special_tokens`` (the class's 202 codes where neither
is listed). M2M100Tokenizer: ``__src__ tokens </s>``, codes ``en`` for the tokens ``__en__`` (its ``language_codes``
set: m2m100 or wmt21). MBart50Tokenizer: ``[src_lang] tokens </s>`` over its 52 fixed codes. The target token is
``convert_tokens_to_ids(tgt_lang)`` (M2M100: ``get_lang_id(tgt_lang)``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

# the classes' own lists, in their order (transformers' FAIRSEQ_LANGUAGE_CODES)
_NLLB = """
ace_Arab ace_Latn acm_Arab acq_Arab aeb_Arab afr_Latn ajp_Arab aka_Latn amh_Ethi apc_Arab arb_Arab ars_Arab
ary_Arab arz_Arab asm_Beng ast_Latn awa_Deva ayr_Latn azb_Arab azj_Latn bak_Cyrl bam_Latn ban_Latn bel_Cyrl
bem_Latn ben_Beng bho_Deva bjn_Arab bjn_Latn bod_Tibt bos_Latn bug_Latn bul_Cyrl cat_Latn ceb_Latn ces_Latn
cjk_Latn ckb_Arab crh_Latn cym_Latn dan_Latn deu_Latn dik_Latn dyu_Latn dzo_Tibt ell_Grek eng_Latn epo_Latn
est_Latn eus_Latn ewe_Latn fao_Latn pes_Arab fij_Latn fin_Latn fon_Latn fra_Latn fur_Latn fuv_Latn gla_Latn
gle_Latn glg_Latn grn_Latn guj_Gujr hat_Latn hau_Latn heb_Hebr hin_Deva hne_Deva hrv_Latn hun_Latn hye_Armn
ibo_Latn ilo_Latn ind_Latn isl_Latn ita_Latn jav_Latn jpn_Jpan kab_Latn kac_Latn kam_Latn kan_Knda kas_Arab
kas_Deva kat_Geor knc_Arab knc_Latn kaz_Cyrl kbp_Latn kea_Latn khm_Khmr kik_Latn kin_Latn kir_Cyrl kmb_Latn
kon_Latn kor_Hang kmr_Latn lao_Laoo lvs_Latn lij_Latn lim_Latn lin_Latn lit_Latn lmo_Latn ltg_Latn ltz_Latn
lua_Latn lug_Latn luo_Latn lus_Latn mag_Deva mai_Deva mal_Mlym mar_Deva min_Latn mkd_Cyrl plt_Latn mlt_Latn
mni_Beng khk_Cyrl mos_Latn mri_Latn zsm_Latn mya_Mymr nld_Latn nno_Latn nob_Latn npi_Deva nso_Latn nus_Latn
nya_Latn oci_Latn gaz_Latn ory_Orya pag_Latn pan_Guru pap_Latn pol_Latn por_Latn prs_Arab pbt_Arab quy_Latn
ron_Latn run_Latn rus_Cyrl sag_Latn san_Deva sat_Beng scn_Latn shn_Mymr sin_Sinh slk_Latn slv_Latn smo_Latn
sna_Latn snd_Arab som_Latn sot_Latn spa_Latn als_Latn srd_Latn srp_Cyrl ssw_Latn sun_Latn swe_Latn swh_Latn
szl_Latn tam_Taml tat_Cyrl tel_Telu tgk_Cyrl tgl_Latn tha_Thai tir_Ethi taq_Latn taq_Tfng tpi_Latn tsn_Latn
tso_Latn tuk_Latn tum_Latn tur_Latn twi_Latn tzm_Tfng uig_Arab ukr_Cyrl umb_Latn urd_Arab uzn_Latn vec_Latn
vie_Latn war_Latn wol_Latn xho_Latn ydd_Hebr yor_Latn yue_Hant zho_Hans zho_Hant zul_Latn
"""
NLLB_CODES = tuple(_NLLB.split())
_MBART50 = """
ar_AR cs_CZ de_DE en_XX es_XX et_EE fi_FI fr_XX gu_IN hi_IN it_IT ja_XX kk_KZ ko_KR lt_LT lv_LV my_MM ne_NP
nl_XX ro_RO ru_RU si_LK tr_TR vi_VN zh_CN af_ZA az_AZ bn_IN fa_IR he_IL hr_HR id_ID ka_GE km_KH mk_MK ml_IN
mn_MN mr_IN pl_PL ps_AF pt_XX sv_SE sw_KE ta_IN te_IN th_TH tl_XX uk_UA ur_PK xh_ZA gl_ES sl_SI
"""
MBART50_CODES = tuple(_MBART50.split())
_M2M100 = """
af am ar ast az ba be bg bn br bs ca ceb cs cy da de el en es et fa ff fi fr fy ga gd gl gu ha he hi hr ht hu
hy id ig ilo is it ja jv ka kk km kn ko lb lg ln lo lt lv mg mk ml mn mr ms my ne nl no ns oc or pa pl ps pt
ro ru sd si sk sl so sq sr ss su sv sw ta th tl tn tr uk ur uz vi wo xh yi yo zh zu
"""
M2M100_CODES = tuple(_M2M100.split())
_WMT21 = """
en ha is ja cs ru zh de
"""
WMT21_CODES = tuple(_WMT21.split())
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
DEFAULT_SOURCE = {"NllbTokenizer": "eng_Latn", "MBart50Tokenizer": "en_XX", "M2M100Tokenizer": "en"}


class LanguageError(ValueError):
    """A language code the model does not know (the message lists the ones it does)."""


def wrap(items: Sequence[T], language: T, eos: T, legacy: bool = False) -> list[T]:
    """The source layout around ``items`` (token texts or ids): ``language items eos``, NLLB's legacy
    ``items eos language``. The one rule both the tokenizer's template and :meth:`Languages.source_ids` follow."""
    return [*items, eos, language] if legacy else [language, *items, eos]


@dataclass(frozen=True)
class Languages:
    """A multilingual tokenizer's language codes: code -> its token's id, the end token, the layout."""

    ids: dict[str, int]  # "fra_Latn" (M2M100: "fr") -> the id of its token
    eos_id: int
    source: str  # the source language of the tokenizer's own template (tokenizer_config.json's src_lang)
    legacy: bool = False  # NLLB's legacy_behaviour: the language token after </s>

    def token_id(self, code: str, field: str = "target_lang") -> int:
        """The id of language ``code``'s token; LanguageError naming ``field`` and listing the codes."""
        if code not in self.ids:
            raise LanguageError(f"{field}={code!r} is not a language code of this model (codes: "
                                f"{', '.join(self.ids)})")
        return self.ids[code]

    def target_id(self, target_lang: str) -> int:
        """The token the decoder is forced to start with for ``target_lang`` (HF's forced_bos_token_id)."""
        return self.token_id(target_lang, "target_lang")

    def source_ids(self, ids: Sequence[int], source_lang: str | None = None) -> list[int]:
        """A text's token ids (no special tokens) laid out as the tokenizer does with ``src_lang=source_lang``
        (None: the directory's own source language)."""
        language = self.token_id(self.source if source_lang is None else source_lang, "source_lang")
        return wrap(list(ids), language, self.eos_id, self.legacy)


def language_tokens(cls: str, settings: dict[str, Any]) -> dict[str, str] | None:
    """Code -> token text for tokenizer class ``cls`` (tokenizer_config.json ``settings``); None for a class without
    languages."""
    if cls == "NllbTokenizer":
        named = {token_text(settings.get(key)) for key in NAMED_TOKENS} | {"<s>", "</s>", "<unk>", "<pad>", "<mask>"}
        listed = settings.get("extra_special_tokens")
        listed = settings.get("additional_special_tokens") if listed is None else listed
        codes = NLLB_CODES if not isinstance(listed, list) else [c for c in map(token_text, listed) if c not in named]
        return {code: code for code in codes if code}
    if cls == "MBart50Tokenizer":
        return {code: code for code in MBART50_CODES}
    if cls == "M2M100Tokenizer":
        codes = M2M100_CODES if settings.get("language_codes", "m2m100") != "wmt21" else WMT21_CODES
        return {code: f"__{code}__" for code in codes}
    return None


def read_languages(cls: str, settings: dict[str, Any], token_id: Callable[[str], int | None],
                   eos_id: int) -> Languages | None:
    """The Languages of tokenizer class ``cls`` (``token_id``: a token text's id, None where absent), or None."""
    tokens = language_tokens(cls, settings)
    if tokens is None:
        return None
    ids = {code: i for code, token in tokens.items() if (i := token_id(token)) is not None}
    source = settings.get("src_lang") or DEFAULT_SOURCE[cls]
    return Languages(ids, eos_id, source, bool(cls == "NllbTokenizer" and settings.get("legacy_behaviour")))


def token_text(value: Any) -> str:
    """An AddedToken's text (its fields as JSON, or the text itself)."""
    text = value.get("content") if isinstance(value, dict) else value
    return text if isinstance(text, str) else ""
